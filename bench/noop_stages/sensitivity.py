"""No-op sensitivity stage for the orchestration benchmark (see bench.noop_stages)."""

from bench.noop_stages import *  # noqa: F403 - every hook but NAME and run is the package's
from bench.noop_stages import __all__ as _shared
from bench.noop_stages import noop_run

NAME = "sensitivity"
run = noop_run(NAME)
__all__ = [*_shared, "NAME", "run"]

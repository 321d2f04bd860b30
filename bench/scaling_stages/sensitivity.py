"""No-op sensitivity stage (see bench.noop_stages)."""

from bench.noop_stages.sensitivity import *  # noqa: F403 - the stage as it is, every name of its __all__
from bench.noop_stages.sensitivity import __all__  # noqa: F401

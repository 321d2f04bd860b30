"""No-op download stage (see bench.noop_stages)."""

from bench.noop_stages.download import (
    FANOUT,
    NAME,
    VERSION,
    Params,
    cache_identity,
    make_params,
    run,
    select_inputs,
)

__all__ = ["NAME", "VERSION", "FANOUT", "Params", "make_params", "select_inputs", "cache_identity", "run"]

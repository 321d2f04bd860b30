"""Stage 3, inspect: validate the checkpoint's structure before any heavy work and write its card."""

from __future__ import annotations

from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import no_memory_need as memory_need
from pipeline.stages.base import nothing_beyond_params as cache_identity
from pipeline.stages.inspect.stage import (
    CARD_NAME,
    NAME,
    SUPPORTED_ARCHITECTURES,
    VERSION,
    Params,
    make_params,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "FANOUT",
    "CARD_NAME",
    "SUPPORTED_ARCHITECTURES",
    "Params",
    "make_params",
    "memory_need",
    "select_inputs",
    "cache_identity",

    "run",
]

# Runs whole: no fan-out by shard.
FANOUT = None

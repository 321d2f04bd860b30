"""Stage 4, calibrate: run the source once; its answers, and the activation statistics recipes ask for."""

from __future__ import annotations

from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import nothing_beyond_params as cache_identity
from pipeline.stages.calibrate.stage import NAME, VERSION, Params, make_params, memory_need, run

__all__ = [
    "NAME", "VERSION", "FANOUT", "Params", "make_params", "memory_need", "select_inputs", "cache_identity",
    "run",
]

# Runs whole: no fan-out by shard.
FANOUT = None

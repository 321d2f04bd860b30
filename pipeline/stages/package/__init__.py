"""Stage 6, package: decompose's parts + metadata + tokenizer -> one verified llama.cpp GGUF file."""

from __future__ import annotations

from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import no_memory_need as memory_need
from pipeline.stages.base import nothing_beyond_params as cache_identity
from pipeline.stages.package.stage import (
    NAME,
    VERSION,
    Params,
    PartTensor,
    make_params,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "FANOUT",
    "Params",
    "make_params",
    "memory_need",
    "select_inputs",
    "cache_identity",

    "run",
    "PartTensor",
]

# Runs whole: no fan-out by shard.
FANOUT = None

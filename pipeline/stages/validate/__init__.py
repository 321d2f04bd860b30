"""Stage 7, validate: run the GGUF in llama.cpp and judge it against the source's stored answers."""

from __future__ import annotations

from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import nothing_beyond_params as cache_identity
from pipeline.stages.validate.stage import (
    DEFAULT_AGREEMENT_TEXT,
    NAME,
    VERSION,
    Check,
    Params,
    ValidationFailed,
    first_answer,
    make_params,
    memory_need,
    repetition_of,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "FANOUT",
    "Params",
    "Check",
    "ValidationFailed",
    "make_params",
    "memory_need",
    "select_inputs",
    "cache_identity",

    "run",
    "repetition_of",
    "first_answer",
    "DEFAULT_AGREEMENT_TEXT",
]

# Runs whole: no fan-out by shard.
FANOUT = None

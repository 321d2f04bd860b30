"""Stage 5, decompose: ternary fitting of every eligible weight, streamed into part files."""

from __future__ import annotations

from pipeline.stages.decompose.stage import (
    FANOUT,
    NAME,
    PART_FORMAT,
    VERSION,
    Params,
    cache_identity,
    make_params,
    memory_need,
    part_name,
    read_part_index,
    run,
    select_inputs,
)

__all__ = [
    "NAME",
    "FANOUT",
    "VERSION",
    "PART_FORMAT",
    "Params",
    "make_params",
    "memory_need",
    "cache_identity",

    "select_inputs",
    "run",
    "read_part_index",
    "part_name",
]

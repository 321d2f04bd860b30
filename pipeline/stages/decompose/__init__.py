"""Stage 4, decompose: ternary fitting of every eligible weight, streamed into part files."""

from __future__ import annotations

from pipeline.stages.decompose.stage import (
    NAME,
    PART_FORMAT,
    VERSION,
    Params,
    make_params,
    part_name,
    read_part_index,
    run,
)

__all__ = [
    "NAME",
    "VERSION",
    "PART_FORMAT",
    "Params",
    "make_params",
    "run",
    "read_part_index",
    "part_name",
]

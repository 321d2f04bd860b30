"""No-op calibrate stage for the orchestration benchmark."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

from bench.noop_stages import (
    FANOUT,
    VERSION,
    Params,
    cache_identity,
    make_params,
    memory_need,
    noop_run,
    select_inputs,
)
from pipeline.stages.base import NO_CLIENTS, InputFile, StageClients, StageResult

NAME = "calibrate"
__all__ = [
    "NAME", "VERSION", "FANOUT", "Params", "make_params", "memory_need", "select_inputs", "cache_identity",
    "run",
]


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    return noop_run(NAME, params, inputs, workdir)

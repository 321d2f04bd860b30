"""Stages that do no work: what is left of a stage's time is the orchestration's overhead.

Each writes one small file whose bytes depend on the job's source and its inputs, so
no two jobs share a cache key and every stage really runs.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

from pipeline.stages.base import NO_CLIENTS, InputFile, JobSpec, OutputFile, StageClients, StageResult
from pipeline.stages.base import every_input as select_inputs
from pipeline.stages.base import no_memory_need as memory_need

__all__ = [
    "VERSION",
    "FANOUT",
    "Params",
    "make_params",
    "memory_need",
    "select_inputs",
    "cache_identity",
]

# Runs whole: no fan-out by shard.
FANOUT = None

VERSION = "noop-1"


@dataclass(frozen=True)
class Params:
    source: str


def make_params(job: JobSpec) -> Params:
    return Params(job.source)


def cache_identity(params: Params, clients: StageClients = NO_CLIENTS) -> None:
    return None  # never reuse: the benchmark measures running stages, not cache hits


def noop_run(name: str) -> Callable[..., StageResult]:
    """The `Stage.run` of the no-op stage ``name``: one small file from the source and input digests."""

    def run(
        params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
    ) -> StageResult:
        digest = hashlib.sha256(params.source.encode())
        for key in sorted(inputs):
            digest.update(inputs[key].sha256.encode())
        out = workdir / f"{name}.txt"
        out.write_text(digest.hexdigest())
        return StageResult(outputs=(OutputFile(f"{name}.txt", out, kind=f"noop-{name}"),))

    return run

"""The real decompose stage, run on the checkpoint in ``BENCH_SCALING_CKPT`` whatever the job says.

The folder holds ``ckpt/`` (the safetensors checkpoint) and ``model_card.json``; each job
decomposes it anew (never cached), as a worker would a new checkpoint of that size.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

from bench.noop_stages import *  # noqa: F403 - the no-op stages' hooks; NAME, VERSION and run are its own
from bench.noop_stages import Params
from bench.noop_stages import __all__ as _shared
from pipeline.core.files import sha256_file
from pipeline.stages import decompose
from pipeline.stages.base import NO_CLIENTS, InputFile, JobSpec, StageClients, StageResult

NAME = "decompose"
VERSION = "scaling-1"
__all__ = [*_shared, "NAME", "run"]


def run(
    params: Params, inputs: Mapping[str, InputFile], workdir: Path, clients: StageClients = NO_CLIENTS
) -> StageResult:
    folder = Path(os.environ["BENCH_SCALING_CKPT"])
    files = {f"download/{p.name}": InputFile(p.name, p, "", p.stat().st_size)
             for p in sorted((folder / "ckpt").iterdir())}
    card = folder / "model_card.json"
    files["inspect/model_card.json"] = InputFile(card.name, card, sha256_file(card), card.stat().st_size)
    return decompose.run(decompose.make_params(JobSpec(params.source, "tq2_0")), files, workdir)

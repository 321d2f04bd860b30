"""One candidate file of the auto recipe, built and scored: what the quality search (decompose) and
the measured sensitivity (its own stage) both run.

The parts are written from the bytes `auto.measure` kept (no refit, no second read of the source),
the package stage's own writer (`stages.gguf_build`) makes the GGUF, and llama.cpp runs it over the
first positions of the calibration text, scored against calibrate's reference of the source
(`calibration.agreement`). Validate's agreement text is never used here, so its confirmation is on
text no trial saw.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.calibration.answers import CALIBRATION
from pipeline.calibration.predictions import AgreementStats
from pipeline.calibration.reference import SourceReference
from pipeline.core.errors import IntegrityError
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile
from pipeline.stages.conversion.auto import Allocation, Candidates, RungBytes, label_of
from pipeline.ternary.policy import Recipe, TensorDecision

__all__ = ["TrialInputs", "assemble", "score_allocation", "TRIAL_POSITIONS"]

# Positions of the calibration text each trial is scored on (its first sequences): top-1 to about
# ±1.5 points, a few seconds of llama.cpp per trial for a small model.
TRIAL_POSITIONS = 1024


@dataclass(frozen=True)
class TrialInputs:
    """What a trial needs: the card and plan, the measured candidates and every tensor's kept bytes,
    the stage's upstream inputs (for the package code) and the source's reference."""

    card: ModelCard
    plan: list[Any]
    recipe: Recipe
    candidates: Candidates
    kept: RungBytes
    inputs: Mapping[str, InputFile]
    reference: SourceReference
    workdir: Path


def assemble(ctx: TrialInputs, allocation: Allocation, folder: Path) -> Path:
    """The allocation's GGUF in ``folder``: parts from the kept bytes, then package's writer."""
    from pipeline.formats.parts import part_name
    from pipeline.stages.conversion.shard import write_kept_part
    from pipeline.stages.gguf_build import Params as PackageParams
    from pipeline.stages.gguf_build import build_gguf

    def fetch(name: str, decision: TensorDecision) -> np.ndarray:
        raw = ctx.kept.get(name, label_of(decision))
        if raw is None:
            raise IntegrityError(f"{name}: no bytes were kept for {label_of(decision)}; this is a bug in the "
                                 "auto search, please report it")
        return raw

    inputs = {key: item for key, item in ctx.inputs.items() if key.startswith(("download/", "inspect/"))}
    for index, shard in enumerate(ctx.card.shards, 1):
        name = part_name(index)
        path = folder / name
        write_kept_part(path, [p for p in ctx.plan if p.shard == shard], allocation.decisions, fetch)
        inputs[f"decompose/{name}"] = InputFile(name, path, "", path.stat().st_size)
    result = build_gguf(PackageParams(model_name="auto-candidate", source="", recipe=ctx.recipe.name),
                        inputs, folder)
    return next(out.path for out in result.outputs if out.name.endswith(".gguf"))


def score_allocation(
    ctx: TrialInputs, allocation: Allocation, label: str, positions: int
) -> tuple[int, AgreementStats]:
    """(file bytes, `calibration.agreement` stats) of the allocation's GGUF, written in a scratch
    folder named after ``label`` and run by llama.cpp over the first ``positions`` positions of the
    calibration text, scored against the source's reference."""
    from pipeline.calibration.agreement import score_gguf

    folder = ctx.workdir / f".{label}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        path = assemble(ctx, allocation, folder)
        size = path.stat().st_size
        threads = max(1, min(8, os.cpu_count() or 1))
        scored = score_gguf(path, ctx.reference, names=[CALIBRATION], n_threads=threads,
                            max_positions=positions)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return size, scored.stats

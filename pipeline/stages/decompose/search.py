"""The auto recipe with a quality target: the smallest budget whose file meets ``min_top1`` / ``max_kl``.

Each budget tried is a real file: `auto.choose` picks the types, the parts are written from the
bytes `auto.measure` kept (no refit, no second read of the source), the package stage's own code
writes the GGUF, and llama.cpp runs it over the first `SEARCH_POSITIONS` positions of the
calibration text, scored against calibrate's reference of the source (`calibration.agreement`).
Validate's agreement text is never used here, so its confirmation is on text the search never saw.

Order of trials: the largest budget (when even that misses, the target is out of reach and the
largest file is kept for validate to judge), the smallest one (a model that bears all its
cheapest types stops there), then bisection between the largest failing and the smallest
passing budget until they are `RESOLUTION_BPW` apart or `MAX_TRIALS` files were tried. A
trial meets ``min_top1`` only with a margin of two standard errors of its own count
(`top1_margin`: 3 points at 0.6 over 1,022 positions).
Bisection assumes agreement grows with the budget: the allocations are nested
(`ternary.allocate.allocate`), so a larger budget's file holds every upgrade of a smaller one's;
a trial that still breaks it (tensors interacting) shows in the report's table of trials.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.calibration.answers import CALIBRATION
from pipeline.calibration.predictions import AgreementStats
from pipeline.calibration.reference import SourceReference
from pipeline.core.errors import InputError, IntegrityError
from pipeline.formats.decompose_report import SearchSummary, SearchTrial, SensitivitySummary
from pipeline.formats.model_card import ModelCard
from pipeline.stages.base import InputFile
from pipeline.stages.decompose.auto import Allocation, Candidates, RungBytes, choose, label_of
from pipeline.ternary.policy import Recipe, TensorDecision, meets_quality

__all__ = ["SearchInputs", "score_allocation", "meets", "top1_margin", "check_reference", "search",
           "MAX_TRIALS", "RESOLUTION_BPW", "SEARCH_POSITIONS"]

log = logging.getLogger(__name__)

MAX_TRIALS = 8
RESOLUTION_BPW = 0.25
# Positions of the calibration text each trial is scored on (its first sequences): top-1 to about
# ±1.5 points, a few seconds of llama.cpp per trial for a small model.
SEARCH_POSITIONS = 1024
_FIX = "retry the job from calibrate (`bonsai retry JOB --from calibrate`)"


@dataclass(frozen=True)
class SearchInputs:
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


def meets(recipe: Recipe, top1: float, mean_kl: float, top1_margin: float = 0.0) -> bool:
    """Whether a file with these figures meets the recipe's quality target (top-1 by ``top1_margin``)."""
    return meets_quality(recipe.min_top1, recipe.max_kl, top1, mean_kl, top1_margin)


def top1_margin(min_top1: float, n_positions: int) -> float:
    """Two standard errors of a top-1 rate of ``min_top1`` counted over ``n_positions``: a trial must
    clear the target by this much, so a file that meets it only by the luck of the text is not
    chosen (validate, on other text, would then likely find it short)."""
    return 2.0 * math.sqrt(min_top1 * (1.0 - min_top1) / max(n_positions, 1))


def check_reference(reference: SourceReference) -> None:
    """InputError unless the reference covers the calibration text (what the trials are scored on)."""
    if CALIBRATION not in reference.sequences.names:
        raise InputError("min_top1 / max_kl score each candidate on the calibration text, but calibrate's "
                         f"reference holds only {sorted(set(reference.sequences.names))}; {_FIX}")


def _assemble(ctx: SearchInputs, allocation: Allocation, folder: Path) -> Path:
    """The allocation's GGUF in ``folder``: parts from the kept bytes, then package's writer."""
    from pipeline.formats.parts import part_name
    from pipeline.stages.decompose.shard import write_kept_part
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
    ctx: SearchInputs, allocation: Allocation, label: str, positions: int
) -> tuple[int, AgreementStats]:
    """(file bytes, `calibration.agreement` stats) of the allocation's GGUF, written in a scratch
    folder named after ``label`` and run by llama.cpp over the first ``positions`` positions of the
    calibration text, scored against the source's reference."""
    from pipeline.calibration.agreement import score_gguf

    folder = ctx.workdir / f".{label}"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    try:
        path = _assemble(ctx, allocation, folder)
        size = path.stat().st_size
        threads = max(1, min(8, os.cpu_count() or 1))
        scored = score_gguf(path, ctx.reference, names=[CALIBRATION], n_threads=threads,
                            max_positions=positions)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    return size, scored.stats


def _try(
    ctx: SearchInputs, bpw: float, weighted: bool, number: int, sensitivity: SensitivitySummary | None
) -> tuple[Allocation, SearchTrial, int]:
    started = time.monotonic()
    allocation = choose(ctx.candidates, ctx.plan, ctx.recipe, bpw, weighted, sensitivity)
    size, stats = score_allocation(ctx, allocation, f"search-{number}", SEARCH_POSITIONS)
    margin = top1_margin(ctx.recipe.min_top1, stats.n_positions)
    trial = SearchTrial(
        target_bpw=round(bpw, 4), spent_bpw=float(allocation.summary.spent_bpw), file_bytes=size,
        top1=round(stats.top1_agreement, 6), mean_kl=round(stats.mean_kl, 6),
        meets=meets(ctx.recipe, stats.top1_agreement, stats.mean_kl, margin),
        seconds=round(time.monotonic() - started, 3), predicted_kl=allocation.summary.predicted_kl,
    )
    log.info("stage decompose: auto trial %d at %.3f bpw: %d bytes, top-1 %.1f%%, KL %.3f -> %s", number,
             bpw, size, 100 * trial.top1, trial.mean_kl, "meets" if trial.meets else "misses")
    return allocation, trial, stats.n_positions


def search(ctx: SearchInputs, weighted: bool, sensitivity: SensitivitySummary | None = None) -> Allocation:
    """The allocation of the smallest budget tried whose file meets the target (else the largest),
    with the trials in its summary under ``search``. The caller has checked the reference
    (`check_reference`) before measuring. ``sensitivity``: the candidates' costs are measured."""
    n_params = ctx.candidates.total_params
    low, high = (b * 8 / n_params for b in ctx.candidates.bytes_range())
    high = min(high, ctx.recipe.target_bpw)
    trials: list[SearchTrial] = []
    allocations: list[Allocation] = []
    positions = 0

    def attempt(bpw: float) -> int:
        nonlocal positions
        allocation, trial, positions = _try(ctx, bpw, weighted, len(trials) + 1, sensitivity)
        trials.append(trial)
        allocations.append(allocation)
        return len(trials) - 1

    best = attempt(high)
    if trials[best].meets and high - low > 1e-9:
        failing = low
        first = attempt(low)
        if trials[first].meets:
            best = first
        while (not trials[first].meets and trials[best].target_bpw - failing > RESOLUTION_BPW
               and len(trials) < MAX_TRIALS):
            tried = attempt((failing + trials[best].target_bpw) / 2)
            if trials[tried].meets:
                best = tried
            else:
                failing = trials[tried].target_bpw
    searched = SearchSummary(
        min_top1=ctx.recipe.min_top1 or None,
        max_kl=ctx.recipe.max_kl or None,
        scored_on=CALIBRATION,
        positions=positions,
        top1_margin=round(top1_margin(ctx.recipe.min_top1, positions), 4) if ctx.recipe.min_top1 else None,
        met=trials[best].meets,
        chosen=best,
        trials=tuple(trials),
    )
    chosen = allocations[best]
    return replace(chosen, summary=replace(chosen.summary, search=searched))

"""The auto recipe with a quality target: the smallest budget whose file meets ``min_top1`` / ``max_kl``.

Each budget tried is a real file: `auto.choose` picks the types and `conversion.trial` builds the
file from the bytes `auto.measure` kept and scores it on the calibration text.

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
import time
from dataclasses import replace

from pipeline.calibration.answers import CALIBRATION
from pipeline.formats.decompose_report import SearchSummary, SearchTrial
from pipeline.formats.sensitivity import SensitivitySummary
from pipeline.stages.conversion.auto import Allocation, choose
from pipeline.stages.conversion.trial import TRIAL_POSITIONS, TrialInputs, score_allocation
from pipeline.ternary.policy import Recipe, meets_quality

__all__ = ["meets", "top1_margin", "search", "MAX_TRIALS", "RESOLUTION_BPW"]

log = logging.getLogger(__name__)

MAX_TRIALS = 8
RESOLUTION_BPW = 0.25


def meets(recipe: Recipe, top1: float, mean_kl: float, top1_margin: float = 0.0) -> bool:
    """Whether a file with these figures meets the recipe's quality target (top-1 by ``top1_margin``)."""
    return meets_quality(recipe.min_top1, recipe.max_kl, top1, mean_kl, top1_margin)


def top1_margin(min_top1: float, n_positions: int) -> float:
    """Two standard errors of a top-1 rate of ``min_top1`` counted over ``n_positions``: a trial must
    clear the target by this much, so a file that meets it only by the luck of the text is not
    chosen (validate, on other text, would then likely find it short)."""
    return 2.0 * math.sqrt(min_top1 * (1.0 - min_top1) / max(n_positions, 1))


def _try(
    ctx: TrialInputs, bpw: float, weighted: bool, number: int, sensitivity: SensitivitySummary | None
) -> tuple[Allocation, SearchTrial, int]:
    started = time.monotonic()
    allocation = choose(ctx.candidates, ctx.plan, ctx.recipe, bpw, weighted, sensitivity)
    size, stats = score_allocation(ctx, allocation, f"search-{number}", TRIAL_POSITIONS)
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


def search(ctx: TrialInputs, weighted: bool, sensitivity: SensitivitySummary | None = None) -> Allocation:
    """The allocation of the smallest budget tried whose file meets the target (else the largest),
    with the trials in its summary under ``search``. The caller has checked the reference
    (`load_reference`) before measuring. ``sensitivity``: the candidates' costs are measured."""
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

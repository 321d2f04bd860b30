"""The auto recipe's measured sensitivity: one file per group step, run by llama.cpp (issue 28).

With ``sensitivity=measured`` the rung costs the allocator ranks on are not the proxy but the
KL each step adds, measured as `ternary.sensitivity` describes: two base files (every candidate
on the top of its hull, and on its cheapest rung), then for each group one file per step (the
steps above the bottom one lowered from the top base, the bottom one raised from the bottom
base), each written from the bytes `auto.measure` kept and scored like a search trial
(`search.score_allocation`) over the first ``positions`` positions of the calibration text. The
cost, two files plus one per step (about 46 for Gemma 3's 7 kinds over 18 layers), is in the
summary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pipeline.calibration.answers import CALIBRATION
from pipeline.formats.decompose_report import SensitivityStep, SensitivitySummary
from pipeline.stages.decompose.auto import allocation_of
from pipeline.stages.decompose.search import SEARCH_POSITIONS, SearchInputs, score_allocation
from pipeline.ternary.allocate import hull
from pipeline.ternary.sensitivity import depths_of, groups_of, lowered, measured_rungs

__all__ = ["measure_sensitivity"]

log = logging.getLogger(__name__)


def measure_sensitivity(
    ctx: SearchInputs, weighted: bool, positions: int = SEARCH_POSITIONS
) -> tuple[SearchInputs, SensitivitySummary]:
    """``ctx`` with its candidates' costs measured (nats of KL), and what was measured."""
    started = time.monotonic()
    rungs = ctx.candidates.rungs
    groups = groups_of(list(rungs))
    top = lowered(rungs, list(rungs), 0)
    bottom = {name: hull(r)[0] for name, r in rungs.items()}
    files = 0

    def score(chosen: dict[str, int]) -> tuple[float, float]:
        nonlocal files
        files += 1
        allocation = allocation_of(ctx.candidates, ctx.plan, ctx.recipe, chosen, ctx.recipe.target_bpw,
                                   weighted)
        _, stats = score_allocation(ctx, allocation, f"sensitivity-{files}", positions)
        return float(stats.mean_kl), float(stats.top1_agreement)

    base_kl, base_top1 = score(top)
    bottom_kl, bottom_top1 = score(bottom)
    steps: list[SensitivityStep] = []

    def step(group: str, depth: int, context: str, upper: dict[str, int], lower: dict[str, int],
             increment: float, top1: float) -> None:
        names = groups[group]
        steps.append(SensitivityStep(
            group=group, depth=depth, types=tuple(sorted({rungs[n][lower[n]].label for n in names})),
            saved_bytes=sum(rungs[n][upper[n]].n_bytes - rungs[n][lower[n]].n_bytes for n in names),
            proxy=round(sum(rungs[n][lower[n]].cost - rungs[n][upper[n]].cost for n in names), 6),
            kl_rise=round(increment, 6), top1=round(top1, 6), context=context,
        ))
        log.info("stage decompose: sensitivity %s step %d (%s, from the %s): KL +%.4f", group, depth,
                 ",".join(steps[-1].types), context, increment)

    for group, names in groups.items():
        deepest = depths_of(rungs, names)
        if not deepest:
            continue  # one rung on every hull: nothing to choose
        upper, kl_upper = lowered(rungs, names, 0), base_kl
        for depth in range(1, deepest):  # from the top: the KL each step down adds
            lower = lowered(rungs, names, depth)
            kl, top1 = score({**top, **lower})
            step(group, depth, "top", upper, lower, kl - kl_upper, top1)
            upper, kl_upper = lower, kl
        # The bottom step, from the bottom: the KL raising the group off its cheapest rungs takes away.
        raised = lowered(rungs, names, deepest - 1)
        kl, top1 = score({**bottom, **raised})
        step(group, deepest, "bottom", raised, lowered(rungs, names, deepest), bottom_kl - kl, top1)
    increments = {(s.group, s.depth): s.kl_rise for s in steps}
    summary = SensitivitySummary(
        scored_on=CALIBRATION, positions=positions, base_kl=round(base_kl, 6), base_top1=round(base_top1, 6),
        files=files, seconds=round(time.monotonic() - started, 3), steps=tuple(steps),
        bottom_kl=round(bottom_kl, 6), bottom_top1=round(bottom_top1, 6),
    )
    measured = replace(ctx.candidates, rungs=measured_rungs(rungs, groups, increments))
    return replace(ctx, candidates=measured), summary

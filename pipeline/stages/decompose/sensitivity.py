"""The auto recipe's measured sensitivity: one file per group step, run by llama.cpp (issue 28).

With ``sensitivity=measured`` the rung costs the allocator ranks on are not the proxy but the
KL each step adds, measured as `ternary.sensitivity` describes: the base file (every candidate
on the top of its hull), then for each group and each depth its hull reaches, the file with that
group lowered, each written from the bytes `auto.measure` kept and scored like a search trial
(`search.score_allocation`) over the first ``positions`` positions of the calibration text. The
cost, one file per step (45 files for Gemma 3 270M: 22 groups, 44 steps), is in the summary.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pipeline.calibration.answers import CALIBRATION
from pipeline.formats.decompose_report import SensitivityStep, SensitivitySummary
from pipeline.stages.decompose.auto import allocation_of
from pipeline.stages.decompose.search import SEARCH_POSITIONS, SearchInputs, score_allocation
from pipeline.ternary.sensitivity import depths_of, groups_of, lowered, measured_rungs

__all__ = ["measure_sensitivity"]

log = logging.getLogger(__name__)


def measure_sensitivity(
    ctx: SearchInputs, weighted: bool, positions: int = SEARCH_POSITIONS
) -> tuple[SearchInputs, SensitivitySummary]:
    """``ctx`` with its candidates' costs measured (nats of KL over the base), and what was measured."""
    started = time.monotonic()
    rungs = ctx.candidates.rungs
    groups = groups_of(list(rungs))
    base = lowered(rungs, list(rungs), 0)
    files = 0

    def score(chosen: dict[str, int]) -> tuple[float, float]:
        nonlocal files
        files += 1
        allocation = allocation_of(ctx.candidates, ctx.plan, ctx.recipe, chosen, ctx.recipe.target_bpw,
                                   weighted)
        _, stats = score_allocation(ctx, allocation, f"sensitivity-{files}", positions)
        return float(stats.mean_kl), float(stats.top1_agreement)

    base_kl, base_top1 = score(base)
    steps: list[SensitivityStep] = []
    for group, names in groups.items():
        for depth in range(1, depths_of(rungs, names) + 1):  # each depth moves some tensor down
            there = lowered(rungs, names, depth)
            kl, top1 = score({**base, **there})
            steps.append(SensitivityStep(
                group=group, depth=depth, types=tuple(sorted({rungs[n][there[n]].label for n in names})),
                saved_bytes=sum(rungs[n][base[n]].n_bytes - rungs[n][there[n]].n_bytes for n in names),
                proxy=round(sum(rungs[n][there[n]].cost - rungs[n][base[n]].cost for n in names), 6),
                kl_rise=round(kl - base_kl, 6), top1=round(top1, 6),
            ))
            log.info("stage decompose: sensitivity %s -%d (%s): KL +%.4f", group, depth,
                     ",".join(steps[-1].types), steps[-1].kl_rise)
    measured = measured_rungs(rungs, groups, {(s.group, s.depth): s.kl_rise for s in steps})
    summary = SensitivitySummary(
        scored_on=CALIBRATION, positions=positions, base_kl=round(base_kl, 6), base_top1=round(base_top1, 6),
        files=files, seconds=round(time.monotonic() - started, 3), steps=tuple(steps),
    )
    return replace(ctx, candidates=replace(ctx.candidates, rungs=measured)), summary

"""The auto recipe's measured sensitivity: one file per group step, run by llama.cpp (issue 28).

`measure_steps` (the sensitivity stage) measures the KL each step adds, as `ternary.sensitivity`
describes: the base file (every candidate on the top of its hull), then for each group and each
depth its hull reaches, the file with that group lowered, each written from the bytes
`auto.measure` kept and scored like a search trial (`trial.score_allocation`) over the first
``positions`` positions of the calibration text. The cost, one file per step (45 files for
Gemma 3 270M: 22 groups, 44 steps), is in the summary. Nothing in it depends on the budget, so
one measurement serves every budget and every later job on the same source and ladder.

Then it walks the chain (`ternary.sensitivity.descend`): from the base, one group step at a time,
the step that adds least KL on top of those taken, measured in that context; so the files of the
chain, which decompose's allocations are points of, account for how the groups' errors compound.

`apply_measured` (decompose) turns it into the candidates' rung costs, after checking that it was
measured on the rungs decompose fitted; `auto.choose` then takes the chain's first point that fits.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from pipeline.calibration.answers import CALIBRATION
from pipeline.core.errors import IntegrityError
from pipeline.formats.sensitivity import RETRY_SENSITIVITY, ChainStep, SensitivityStep, SensitivitySummary
from pipeline.stages.conversion.auto import Candidates, allocation_of
from pipeline.stages.conversion.trial import TRIAL_POSITIONS, TrialInputs, score_allocation
from pipeline.ternary.allocate import Rung
from pipeline.ternary.sensitivity import depths_of, descend, groups_of, lowered, measured_rungs, step_bytes

__all__ = ["measure_steps", "apply_measured"]

log = logging.getLogger(__name__)


def _step(rungs: dict[str, list[Rung]], group: str, names: list[str], depth: int) -> SensitivityStep:
    """The step's rungs and bytes; its KL and top-1 are filled in once measured."""
    base, there = lowered(rungs, names, 0), lowered(rungs, names, depth)
    return SensitivityStep(
        group=group, depth=depth, types=tuple(sorted({rungs[n][there[n]].label for n in names})),
        saved_bytes=sum(rungs[n][base[n]].n_bytes - rungs[n][there[n]].n_bytes for n in names),
        proxy=round(sum(rungs[n][there[n]].cost - rungs[n][base[n]].cost for n in names), 6),
        kl_rise=0.0, top1=0.0,
    )


def _steps(rungs: dict[str, list[Rung]]) -> list[SensitivityStep]:
    """Every group's steps from the base: each depth its hull reaches moves some tensor down."""
    return [_step(rungs, group, names, depth) for group, names in groups_of(list(rungs)).items()
            for depth in range(1, depths_of(rungs, names) + 1)]


def measure_steps(ctx: TrialInputs, weighted: bool, positions: int = TRIAL_POSITIONS) -> SensitivitySummary:
    """The KL (nats) each group step adds over the base, with the base's own figures and the cost."""
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
    for step in _steps(rungs):
        kl, top1 = score({**base, **lowered(rungs, groups[step.group], step.depth)})
        steps.append(replace(step, kl_rise=round(kl - base_kl, 6), top1=round(top1, 6)))
        log.info("stage sensitivity: %s -%d (%s): KL +%.4f", step.group, step.depth, ",".join(step.types),
                 steps[-1].kl_rise)
    single = files
    chain = descend(rungs, groups, {(s.group, s.depth): s.kl_rise for s in steps}, base_kl, score)
    log.info("stage sensitivity: the chain took %d files for %d steps (measured down to KL %.3f)",
             files - single, len(chain), max((c.kl for c in chain if c.kl is not None), default=base_kl))
    return SensitivitySummary(
        scored_on=CALIBRATION, positions=positions, base_kl=round(base_kl, 6), base_top1=round(base_top1, 6),
        files=files, seconds=round(time.monotonic() - started, 3), steps=tuple(steps), chain=tuple(chain),
    )


def _chain_fits(rungs: dict[str, list[Rung]], chain: tuple[ChainStep, ...]) -> bool:
    """Whether the chain takes each group's steps in order, to its deepest, saving the bytes they save."""
    groups = groups_of(list(rungs))
    depth = dict.fromkeys(groups, 0)
    for step in chain:
        names = groups.get(step.group)
        if names is None or step.depth != depth[step.group] + 1:
            return False
        if step.saved_bytes != step_bytes(rungs, names, step.depth):
            return False
        depth[step.group] = step.depth
    return all(depth[group] == depths_of(rungs, names) for group, names in groups.items())


def apply_measured(candidates: Candidates, measured: SensitivitySummary) -> Candidates:
    """``candidates`` with their costs measured (nats of KL over the base). IntegrityError when the
    summary's steps are not these candidates' (another ladder, rungs or tensors)."""
    rungs = candidates.rungs
    here = {(s.group, s.depth): (s.types, s.saved_bytes) for s in _steps(rungs)}
    there = {(s.group, s.depth): (s.types, s.saved_bytes) for s in measured.steps}
    if measured.chain and not _chain_fits(rungs, measured.chain):
        raise IntegrityError("sensitivity.json's chain does not go down the rungs decompose fitted; "
                             f"{RETRY_SENSITIVITY}")
    if here != there:
        odd = sorted(set(here.items()) ^ set(there.items()))[:3]
        raise IntegrityError(f"sensitivity.json was measured on other rungs than decompose fitted "
                             f"({len(here)} steps here, {len(there)} there; differing: {odd}); "
                             f"{RETRY_SENSITIVITY}")
    rises = {(s.group, s.depth): s.kl_rise for s in measured.steps}
    return replace(candidates, rungs=measured_rungs(rungs, groups_of(list(rungs)), rises), fitted=rungs)

"""A job's own stage graph, decided when the job is planned (from its recipe) and narrowed when
decompose's verdict is in.

The sensitivity stage is in the graph only of an auto job with ``sensitivity=measured``: it measures
once per source and ladder what decompose allocates every budget on.

Decompose reads calibrate's outputs only under recipes that ask for statistics (an importance
matrix, gptq's Gram matrices, a quality target). For every other recipe calibrate's only reader is
validate, and it needs the source's reference only when the conversion is lossy, which decompose
proves or refutes on the bytes it writes. Such a job lists calibrate after package; once decompose
proves the conversion exact, calibrate's first attempt is not needed (`JobPlan.unneeded`): validate
runs the file alone and the job does not wait for it.

When calibrate may start is the scheduler's call (`JobPlan.waits_for`): on one machine it waits for
decompose's verdict, so an exact conversion never runs the source; with spare workers it starts
beside decompose, and a result no one reads is kept for later jobs of the same checkpoint.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Protocol

from pipeline.core.errors import InputError
from pipeline.core.states import StageName, StageState, stage_inputs, topological_order

__all__ = ["JobPlan", "plan_for", "calibrate_not_needed"]

Graph = Mapping[StageName, tuple[StageName, ...]]


class _Attempt(Protocol):
    attempt: int
    status: StageState
    metrics: Any


@dataclass(frozen=True)
class JobPlan:
    """``inputs``: the job's graph (what each stage may read; retry sets follow it); ``order``: the
    order shown to users; ``calibrate_if_lossy``: calibrate is read only for a lossy conversion;
    ``verdict``: decompose's (True exact, False lossy, None not yet known); ``unneeded``: stages whose
    readers turned out not to need them."""

    inputs: Graph
    order: tuple[StageName, ...]
    calibrate_if_lossy: bool
    verdict: bool | None = None
    unneeded: frozenset[StageName] = frozenset()

    def reads(self, stage: StageName) -> tuple[StageName, ...]:
        """The stages whose outputs `stage` reads in this job."""
        return tuple(s for s in self.inputs[stage] if s not in self.unneeded)

    @property
    def stages(self) -> tuple[StageName, ...]:
        """The stages the job still needs, in its order."""
        return tuple(s for s in self.order if s not in self.unneeded)

    def waits_for(self, *, spare_workers: bool) -> Graph:
        """What each stage waits for before it may start: what it reads, and, for a calibrate that
        only a lossy conversion needs, decompose's verdict unless other workers can run it meanwhile."""
        graph = {stage: self.reads(stage) for stage in self.stages}
        if self.calibrate_if_lossy and not spare_workers and StageName.CALIBRATE in graph:
            graph[StageName.CALIBRATE] += (StageName.DECOMPOSE,)
        return MappingProxyType(graph)


def plan_for(recipe: str, options: Mapping[str, Any] | None,
             latest: Mapping[StageName, _Attempt] | None = None) -> JobPlan:
    """The plan of a job with this recipe and these options, given its newest attempts per stage
    (a recipe that cannot be read keeps every stage but sensitivity: its stages report the fault)."""
    from pipeline.ternary.policy import MEASURED, get_recipe, reads_statistics

    try:
        reads = reads_statistics(recipe, dict(options or {}))
        measures = get_recipe(recipe, dict(options or {})).sensitivity == MEASURED
    except InputError:
        reads, measures = True, False
    inputs = stage_inputs(decompose_reads_calibrate=reads, measures_sensitivity=measures)
    defer = () if reads else (StageName.CALIBRATE,)
    plan = JobPlan(inputs, topological_order(inputs, defer), calibrate_if_lossy=not reads)
    decompose = (latest or {}).get(StageName.DECOMPOSE)
    if not plan.calibrate_if_lossy or decompose is None or not decompose.status.is_done or (
            "exact" not in (decompose.metrics or {})):
        return plan
    exact = decompose.metrics["exact"] is True
    calibrate = (latest or {}).get(StageName.CALIBRATE)
    # Only the first attempt is spared: a retry from calibrate asks for the source's reference.
    first_turn = calibrate is None or calibrate.attempt <= 1
    unneeded = frozenset({StageName.CALIBRATE}) if exact and first_turn else frozenset()
    return JobPlan(inputs, plan.order, True, exact, unneeded)


def calibrate_not_needed(plan: JobPlan) -> str | None:
    """Why calibrate is not needed in this plan; None when it is (or may be)."""
    if StageName.CALIBRATE not in plan.unneeded:
        return None
    return ("not needed: decompose proved the conversion exact (every tensor's bytes decode to the "
            "source's values bit for bit; report.json), so validate runs the file alone")

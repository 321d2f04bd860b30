"""Pure decisions over a job's stage runs: which stages can run now, and what a retry re-opens.

No I/O here: callers pass the newest attempt's status per stage and act on the answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from pipeline.core.states import (
    DONE_STATES,
    STAGE_INPUTS,
    STAGE_ORDER,
    StageName,
    StageState,
    downstream_of,
    topological_order,
)

__all__ = ["Frontier", "Step", "frontier", "progress", "retry_stages"]

_IN_FLIGHT = (StageState.QUEUED, StageState.RUNNING)


@dataclass(frozen=True)
class Step:
    """An attempt to run (or send) now, or one already queued or running elsewhere; ``delay_s`` is a
    retry's backoff and ``task_id`` the broker message an attempt was queued under."""

    stage: StageName
    run_id: int
    delay_s: float = 0.0
    task_id: str | None = None


@dataclass(frozen=True)
class Frontier:
    """The stages not done whose inputs are: ``ready`` (no attempt, or a pending one), ``in_flight``
    (queued or running) and ``stopped`` (the newest attempt failed or was cancelled), each in the
    job's order. All three empty: every stage is done."""

    ready: tuple[StageName, ...] = ()
    in_flight: tuple[StageName, ...] = ()
    stopped: tuple[StageName, ...] = ()

    @property
    def done(self) -> bool:
        return not (self.ready or self.in_flight or self.stopped)

    @property
    def current(self) -> StageName | None:
        """The stage to show as the job's current one."""
        return next(iter(self.in_flight + self.stopped + self.ready), None)


def frontier(latest: Mapping[StageName, StageState],
             after: Mapping[StageName, tuple[StageName, ...]] = STAGE_INPUTS,
             order: Sequence[StageName] | None = None) -> Frontier:
    """Every stage of ``order`` (default: the graph's own order) that can move: its newest state in
    ``latest`` is not done and every stage it waits for in ``after`` is. A queued or running stage
    counts whatever its inputs."""
    if order is None:
        order = topological_order(after)
    ready: list[StageName] = []
    in_flight: list[StageName] = []
    stopped: list[StageName] = []
    for stage in order:
        state = latest.get(stage)
        if state in DONE_STATES:
            continue
        if state in _IN_FLIGHT:
            in_flight.append(stage)
        elif all(latest.get(before) in DONE_STATES for before in after[stage]):
            (ready if state is None or state is StageState.PENDING else stopped).append(stage)
    return Frontier(tuple(ready), tuple(in_flight), tuple(stopped))


def progress(latest: Mapping[StageName, StageState], order: Sequence[StageName] = STAGE_ORDER) -> float:
    """Fraction of the stages of ``order`` (the job's) done, in [0, 1]."""
    done = sum(1 for stage in order if latest.get(stage) in DONE_STATES)
    return done / len(order)


def retry_stages(
    latest: Mapping[StageName, StageState], from_stage: StageName | None,
    order: Sequence[StageName] = STAGE_ORDER,
    inputs: Mapping[StageName, tuple[StageName, ...]] = STAGE_INPUTS,
) -> tuple[StageName, ...]:
    """Stages that get a new attempt on retry: `from_stage` (default: the first not done in ``order``)
    and what depends on it in the job's graph ``inputs``."""
    if from_stage is None:
        from_stage = next((s for s in order if latest.get(s) not in DONE_STATES), None)
        if from_stage is None:
            return ()
    return downstream_of(from_stage, inputs)

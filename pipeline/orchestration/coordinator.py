"""Pure decisions over a job's stage runs: what runs next, and what a retry re-opens.

No I/O here: callers pass the newest attempt's status per stage and act on the answer.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from enum import StrEnum

from pipeline.core.states import DONE_STATES, STAGE_INPUTS, STAGE_ORDER, StageName, StageState, downstream_of

__all__ = ["StepKind", "Step", "next_step", "progress", "retry_stages"]



class StepKind(StrEnum):
    """What comes next for a job: the one vocabulary of the coordinator and of `progression`."""

    RUN = "run"  # an attempt is ready (no attempt yet, or a pending one): run or send it
    WAIT = "wait"  # an attempt is queued or running
    STOPPED = "stopped"  # the newest attempt failed or was cancelled; `progression` decides what follows
    DONE = "done"  # every stage succeeded
    FAILED = "failed"  # stopped for good: no retry left
    CANCELLED = "cancelled"


@dataclass(frozen=True)
class Step:
    """A job's next step; ``run_id`` and ``delay_s`` are filled in once an attempt row exists."""

    kind: StepKind
    stage: StageName | None = None
    run_id: int | None = None
    delay_s: float = 0.0


def next_step(latest: Mapping[StageName, StageState], order: Sequence[StageName] = STAGE_ORDER) -> Step:
    """Walk the stages in ``order`` (the job's plan); the first one not done decides (RUN, WAIT,
    STOPPED or DONE)."""
    for stage in order:
        state = latest.get(stage)
        if state is None or state is StageState.PENDING:
            return Step(StepKind.RUN, stage)
        if state in (StageState.QUEUED, StageState.RUNNING):
            return Step(StepKind.WAIT, stage)
        if state in (StageState.FAILED, StageState.CANCELLED):
            return Step(StepKind.STOPPED, stage)
    return Step(StepKind.DONE)


def progress(latest: Mapping[StageName, StageState]) -> float:
    """Fraction of stages done, in [0, 1]."""
    done = sum(1 for stage in STAGE_ORDER if latest.get(stage) in DONE_STATES)
    return done / len(STAGE_ORDER)


def retry_stages(
    latest: Mapping[StageName, StageState], from_stage: StageName | None,
    order: Sequence[StageName] = STAGE_ORDER,
    inputs: Mapping[StageName, tuple[StageName, ...]] = STAGE_INPUTS,
) -> tuple[StageName, ...]:
    """Stages that get a new attempt on retry: `from_stage` (default: the first not done in ``order``)
    and what depends on it in the job's graph ``inputs``."""
    if from_stage is None:
        decision = next_step(latest, order)
        if decision.stage is None:
            return ()
        from_stage = decision.stage
    return downstream_of(from_stage, inputs)

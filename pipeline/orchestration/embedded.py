"""Embedded mode: run a job's stages one after another in this process.

The loop asks `advance_job` what comes next and hands the attempt to `execute_run`,
exactly as a Celery task would, so both modes record the same rows.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.coordinator import StepKind
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.progression import advance_job
from pipeline.orchestration.runtime import Runtime

__all__ = ["run_job", "StageEvent"]

log = logging.getLogger(__name__)

_DEFER_S = 1.0
_FINAL = {StepKind.DONE: JobState.SUCCEEDED, StepKind.FAILED: JobState.FAILED,
          StepKind.CANCELLED: JobState.CANCELLED}


@dataclass(frozen=True)
class StageEvent:
    """Reported to the progress callback before and after each stage."""

    job_id: int
    stage: StageName
    state: StageState
    duration_s: float | None = None
    message: str | None = None


def run_job(rt: Runtime, job_id: int, on_event: Callable[[StageEvent], None] | None = None) -> JobState:
    """Run every remaining stage of `job_id` in order; returns the job's final state."""
    notify = on_event or (lambda _event: None)
    while True:
        with session_scope(rt.sessions) as session:
            step = advance_job(session, job_id, max_attempts=rt.max_attempts, retry_base_s=rt.retry_base_s)
        if step.kind in _FINAL:
            return _FINAL[step.kind]
        assert step.stage is not None and step.run_id is not None
        if step.kind is StepKind.WAIT:
            # Another process holds this attempt; embedded mode does not steal it.
            raise RuntimeError(f"job {job_id}: stage {step.stage.value} is queued or running elsewhere")
        if step.delay_s:
            log.info("job %s stage %s: retrying in %.1fs", job_id, step.stage.value, step.delay_s)
            time.sleep(step.delay_s)
        notify(StageEvent(job_id, step.stage, StageState.RUNNING))
        state = execute_run(rt, step.run_id)
        if state in (StageState.PENDING, StageState.QUEUED):
            time.sleep(_DEFER_S)  # an equal run is in flight in another process: wait for its result
            continue
        with session_scope(rt.sessions) as session:
            run = session.get_one(StageRun, step.run_id)
            notify(StageEvent(job_id, step.stage, state, run.duration_s, run.error_message))

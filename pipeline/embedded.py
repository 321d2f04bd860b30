"""Embedded mode: run a job's stages one after another in this process.

The loop asks the coordinator what comes next, adds an attempt row and hands it to
`execute_run`, exactly as a Celery task would, so both modes record the same rows.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

from pipeline import coordinator
from pipeline.coordinator import Action
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.execution import Runtime, execute_run
from pipeline.states import JobState, StageName, StageState

__all__ = ["run_job", "latest_states", "StageEvent"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class StageEvent:
    """Reported to the progress callback before and after each stage."""

    job_id: int
    stage: StageName
    state: StageState
    duration_s: float | None = None
    message: str | None = None


def latest_states(session, job_id: int) -> dict[StageName, StageState]:  # type: ignore[no-untyped-def]
    return {stage: StageState(run.status) for stage, run in repo.latest_runs(session, job_id).items()}


def run_job(rt: Runtime, job_id: int, on_event: Callable[[StageEvent], None] | None = None) -> JobState:
    """Run every remaining stage of `job_id` in order; returns the job's final state."""
    notify = on_event or (lambda _event: None)
    while True:
        with session_scope(rt.sessions) as session:
            job = repo.get_job(session, job_id)
            if JobState(job.status) is JobState.CANCELLED:
                return JobState.CANCELLED
            decision = coordinator.next_step(latest_states(session, job_id))
            if decision.action is Action.DONE:
                repo.set_job_state(session, job, JobState.SUCCEEDED)
                return JobState.SUCCEEDED
            if decision.action is Action.STOPPED:
                failed = repo.latest_runs(session, job_id)[decision.stage]  # type: ignore[index]
                message = f"{decision.stage.value} failed: {failed.error_message}"  # type: ignore[union-attr]
                repo.set_job_state(session, job, JobState.FAILED, error_message=message)
                return JobState.FAILED
            if decision.action is Action.WAIT:
                # Another process holds this attempt; embedded mode does not steal it.
                stage_name = decision.stage.value  # type: ignore[union-attr]
                raise RuntimeError(f"job {job_id}: stage {stage_name} is queued or running in another process")
            stage = decision.stage
            assert stage is not None
            repo.set_job_state(session, job, JobState.RUNNING)
            latest = repo.latest_runs(session, job_id).get(stage)
            run = latest if latest is not None and latest.status == StageState.PENDING.value else None
            run = run or repo.new_attempt(session, job, stage)
            run_id = run.id
        notify(StageEvent(job_id, stage, StageState.RUNNING))
        state = execute_run(rt, run_id)
        with session_scope(rt.sessions) as session:
            run = session.get_one(StageRun, run_id)
            notify(StageEvent(job_id, stage, state, run.duration_s, run.error_message))

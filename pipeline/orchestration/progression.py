"""Move a job forward one step in the database: queue the next attempt, retry, or finish.

Both modes call `advance_job`: the embedded loop runs the returned attempt itself, the
distributed dispatcher sends it to a queue. Keeping "what runs next" here, in the
database, rather than in Celery canvas primitives, means a lost message or a
restarted broker loses nothing: the reconciler calls the same function again.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Job, StageRun
from pipeline.orchestration import coordinator
from pipeline.orchestration.coordinator import Step, StepKind
from pipeline.orchestration.plan import JobPlan, calibrate_not_needed, plan_for

__all__ = ["advance_job", "retry_delay_s", "WORKER_LOST", "OUT_OF_MEMORY"]

# error_message prefixes of attempts whose worker died or vanished, or that outgrew their memory cap.
WORKER_LOST = "worker lost"
OUT_OF_MEMORY = "out of memory"


def retry_delay_s(attempt: int, base_s: float, cap_s: float = 600.0) -> float:
    """Exponential backoff before attempt `attempt + 1`: base, 2×base, 4×base… capped."""
    return float(min(cap_s, base_s * 2 ** max(0, attempt - 1)))


def _lock_job(session: Session, job_id: int) -> Job:
    # Row lock on PostgreSQL: two finishing stages of one job never both queue the next.
    job = session.execute(select(Job).where(Job.id == job_id).with_for_update()).scalar_one_or_none()
    if job is None:
        return repo.get_job(session, job_id)  # raises the clear "does not exist" error
    return job


def advance_job(
    session: Session,
    job_id: int,
    *,
    max_attempts: int,
    retry_base_s: float,
    task_id: str | None = None,
) -> Step:
    """Decide and record the job's next step. With `task_id`, the attempt is marked queued."""
    job = _lock_job(session, job_id)
    if JobState(job.status) is JobState.CANCELLED:
        return Step(StepKind.CANCELLED)
    plan = plan_for(job.recipe, job.params)
    latest = repo.latest_runs(session, job_id)
    decision = coordinator.next_step(_states(latest), plan.order)
    if _settle_calibrate(session, job, plan, decision, latest):
        latest = repo.latest_runs(session, job_id)
        decision = coordinator.next_step(_states(latest), plan.order)
    if decision.kind is StepKind.DONE:
        repo.set_job_state(session, job, JobState.SUCCEEDED)
        return Step(StepKind.DONE)
    stage = decision.stage
    assert stage is not None
    if decision.kind is StepKind.WAIT:
        return Step(StepKind.WAIT, stage, latest[stage].id)
    if decision.kind is StepKind.RUN:
        pending = latest.get(stage)
        run = pending if pending is not None else repo.new_attempt(session, job, stage)
        return _ready(session, job, run, task_id, 0.0)
    failed = latest[stage]
    if failed.status == StageState.CANCELLED.value:
        repo.set_job_state(session, job, JobState.CANCELLED)
        return Step(StepKind.CANCELLED)
    if failed.error_kind == "retryable" and failed.attempt < max_attempts:
        again = repo.retry_attempt(session, failed)
        if again is None:  # retried already by another process: that attempt decides
            return Step(StepKind.WAIT, stage, failed.id)
        return _ready(session, job, again, task_id, retry_delay_s(failed.attempt, retry_base_s))
    repo.set_job_state(session, job, JobState.FAILED, error_message=_failure_reason(session, job, failed))
    return Step(StepKind.FAILED, stage, failed.id)


def _states(latest: dict[StageName, StageRun]) -> dict[StageName, StageState]:
    return {stage: StageState(run.status) for stage, run in latest.items()}


def _settle_calibrate(session: Session, job: Job, plan: JobPlan, decision: Step,
                      latest: dict[StageName, StageRun]) -> bool:
    """Record calibrate as not needed when its turn comes in a job whose decompose proved the
    conversion exact (its first attempt only: a retry from calibrate runs it). True if recorded."""
    is_first_turn = decision.kind is StepKind.RUN and decision.stage is StageName.CALIBRATE and (
        StageName.CALIBRATE not in latest)
    if not (plan.calibrate_if_lossy and is_first_turn):
        return False
    decompose = latest.get(StageName.DECOMPOSE)
    reason = calibrate_not_needed(decompose.metrics if decompose is not None else None)
    if reason is None:
        return False
    run = repo.new_attempt(session, job, StageName.CALIBRATE)
    repo.set_stage_state(session, run, StageState.NOT_NEEDED, metrics={"not_needed": reason})
    return True


def _ready(session: Session, job: Job, run: StageRun, task_id: str | None, delay_s: float) -> Step:
    if JobState(job.status) is not JobState.RUNNING:
        repo.set_job_state(session, job, JobState.RUNNING)
    if task_id is not None:
        repo.set_stage_state(session, run, StageState.QUEUED, task_id=task_id)
    return Step(StepKind.RUN, StageName(run.stage), run.id, delay_s)


def _failure_reason(session: Session, job: Job, failed: StageRun) -> str:
    attempts = session.scalars(
        select(StageRun).where(
            StageRun.job_id == job.id, StageRun.stage == failed.stage, StageRun.shard == ""
        )
    ).all()
    for cause in (WORKER_LOST, OUT_OF_MEMORY):
        count = sum(1 for run in attempts if (run.error_message or "").startswith(cause))
        if failed.error_kind == "retryable" and count == len(attempts):
            return f"{failed.stage} failed: {cause} {count} times (last: {failed.error_message})"
    if failed.error_kind == "retryable":
        return f"{failed.stage} failed after {len(attempts)} attempts: {failed.error_message}"
    return f"{failed.stage} failed: {failed.error_message}"

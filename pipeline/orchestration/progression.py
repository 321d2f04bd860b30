"""Move a job forward in the database: queue every stage whose inputs are ready, retry, or finish.

Both modes call `advance_job`: the embedded loop runs the returned attempts itself, the
distributed dispatcher sends each to its queue. Keeping "what runs next" here, in the
database, rather than in Celery canvas primitives, means a lost message or a
restarted broker loses nothing: the reconciler calls the same function again.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Job, StageRun
from pipeline.orchestration import coordinator
from pipeline.orchestration.coordinator import Step
from pipeline.orchestration.plan import JobPlan, calibrate_not_needed, plan_for
from pipeline.orchestration.queues import QUEUE_OF

__all__ = ["Advance", "advance_job", "retry_delay_s", "WORKER_LOST", "OUT_OF_MEMORY"]

# error_message prefixes of attempts whose worker died or vanished, or that outgrew their memory cap.
WORKER_LOST = "worker lost"
OUT_OF_MEMORY = "out of memory"


@dataclass(frozen=True)
class Advance:
    """What a job does next: the attempts to run or send now (``ready``), those queued or running
    (``in_flight``), and the job's state once it has ended (``final``)."""

    ready: tuple[Step, ...] = ()
    in_flight: tuple[Step, ...] = ()
    final: JobState | None = None


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
    spare_workers: bool = False,
    queue: bool = False,
    workers_since: datetime | None = None,
) -> Advance:
    """Decide and record the job's next steps: an attempt for every stage whose inputs are done.

    ``spare_workers``: other workers can run a stage whose need is not yet known (calibrate beside
    decompose). ``queue``: each ready attempt is marked queued under a new task id (its Step's).
    ``workers_since``: workers that beat since then are alive; an attempt a worker refused as too
    big for its memory cap is then retried without counting while an alive worker of the stage's
    queue can hold it, and fails the job at once when none can (`_bigger_worker`).
    An ended job is left as it is (a stage that finishes after its job failed queues nothing).
    """
    job = _lock_job(session, job_id)
    if job.status.is_final:
        return Advance(final=job.status)
    latest = repo.latest_runs(session, job_id)
    plan = plan_for(job.recipe, job.params, latest)
    if _settle_unneeded(session, job, plan, latest):
        latest = repo.latest_runs(session, job_id)
    front = coordinator.frontier(_states(latest), plan.waits_for(spare_workers=spare_workers), plan.stages)
    ready: list[Step] = []
    in_flight = [Step(stage, latest[stage].id) for stage in front.in_flight]
    for stage in front.stopped:
        if stage is StageName.CALIBRATE and plan.calibrate_if_lossy and plan.verdict is None:
            continue  # started early: whether its failure matters waits for decompose's verdict
        failed = latest[stage]
        if failed.status == StageState.CANCELLED:
            repo.set_job_state(session, job, JobState.CANCELLED)
            return Advance(final=JobState.CANCELLED)
        waits, no_worker = _waits_for_bigger_worker(session, failed, workers_since)
        if no_worker:
            repo.set_job_state(session, job, JobState.FAILED, error_message=no_worker)
            return Advance(final=JobState.FAILED)
        if failed.error_kind != "retryable" or (failed.attempt >= max_attempts and not waits):
            reason = _failure_reason(session, job, failed)
            repo.set_job_state(session, job, JobState.FAILED, error_message=reason)
            return Advance(final=JobState.FAILED)
        again = repo.retry_attempt(session, failed)
        if again is None:  # retried already by another process: that attempt decides
            in_flight.append(Step(stage, failed.id))
        else:
            ready.append(_ready(session, job, again, queue, retry_delay_s(failed.attempt, retry_base_s)))
    if front.done:
        repo.set_job_state(session, job, JobState.SUCCEEDED)
        return Advance(final=JobState.SUCCEEDED)
    for stage in front.ready:
        run = latest.get(stage) or repo.new_attempt(session, job, stage)
        ready.append(_ready(session, job, run, queue, 0.0))
    return Advance(tuple(ready), tuple(in_flight))


def _waits_for_bigger_worker(session: Session, failed: StageRun,
                             workers_since: datetime | None) -> tuple[bool, str | None]:
    """For an attempt refused as too big for its worker: (whether an alive worker of its queue can hold
    it, so the job waits without counting the refusal; the job's failure message when none can)."""
    need = (failed.metrics or {}).get("memory_need_bytes")
    if workers_since is None or not isinstance(need, int) or failed.error_kind != "retryable":
        return False, None
    queue = QUEUE_OF[failed.stage]
    serving = [w for w in repo.live_workers(session, workers_since) if queue in (w.queues or [])]
    if any(w.memory_limit_mb is None or w.memory_limit_mb << 20 >= need for w in serving):
        return True, None
    caps = [w.memory_limit_mb for w in serving if w.memory_limit_mb is not None]
    largest = f"the largest cap is {max(caps):,} MB" if caps else "none is alive"
    return False, (f"{failed.stage} needs about {need >> 20:,} MB and no worker of queue {queue!r} can "
                   f"hold it ({largest}); start one there with BONSAI_WORKER_MEMORY_MB of at least "
                   f"{(need >> 20) + 1:,} (or none), then `bonsai retry {failed.job_id}`")


def _states(latest: dict[StageName, StageRun]) -> dict[StageName, StageState]:
    return {stage: run.status for stage, run in latest.items()}


def _settle_unneeded(session: Session, job: Job, plan: JobPlan, latest: dict[StageName, StageRun]) -> bool:
    """Record calibrate as not needed once decompose proved the conversion exact, unless its attempt
    runs or ran (its result is kept for later jobs; the job does not wait for it). An attempt started
    early that failed is not needed either: its failure moves into its metrics (``failure``), its log
    stays. True if recorded."""
    reason = calibrate_not_needed(plan)
    run = latest.get(StageName.CALIBRATE)
    settles = (StageState.PENDING, StageState.QUEUED, StageState.FAILED)
    if reason is None or (run is not None and run.status not in settles):
        return False
    run = run if run is not None else repo.new_attempt(session, job, StageName.CALIBRATE)
    metrics: dict[str, Any] = {"not_needed": reason}
    if run.status is StageState.FAILED:
        failed_first = f"{reason}; it had failed first ({run.error_message}), which no longer matters"
        metrics = {**(run.metrics or {}), "failure": {"kind": run.error_kind, "message": run.error_message},
                   "not_needed": failed_first}
    repo.set_stage_state(session, run, StageState.NOT_NEEDED, metrics=metrics, error_kind=None,
                         error_message=None)
    return True


def _ready(session: Session, job: Job, run: StageRun, queue: bool, delay_s: float) -> Step:
    if job.status is not JobState.RUNNING:
        repo.set_job_state(session, job, JobState.RUNNING)
    task_id = str(uuid.uuid4()) if queue else None
    if task_id is not None:
        repo.set_stage_state(session, run, StageState.QUEUED, task_id=task_id)
    return Step(run.stage, run.id, delay_s, task_id)


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

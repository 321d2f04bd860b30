"""The only module that enqueues work: record the next attempt as queued, then send it.

The row is committed (with its task id) before the message is sent. If sending
fails, the attempt stays queued and the reconciler sends it again later; if the
message is delivered twice, the atomic claim makes the second delivery a no-op.
"""

from __future__ import annotations

import logging
import uuid

from sqlalchemy.orm import Session, sessionmaker

from pipeline.core.settings import Settings
from pipeline.core.states import StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Job, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed.celery_app import QUEUE_OF, app, task_name
from pipeline.orchestration.execution import Runtime, join_parent
from pipeline.orchestration.progression import Step, StepKind, advance_job

__all__ = ["advance", "send", "resend", "join", "celery_priority"]

log = logging.getLogger(__name__)


def celery_priority(job_priority: int) -> int:
    """Job priority (higher runs sooner, default 0) to the broker's 0 (first) .. 9 (last)."""
    return max(0, min(9, 5 - job_priority))


def send(
    stage: StageName, run_id: int, task_id: str, job_priority: int = 0, countdown_s: float = 0.0
) -> bool:
    """Publish "run stage run `run_id`"; False when the broker could not take it."""
    try:
        app.send_task(
            task_name(stage),
            args=[run_id],
            task_id=task_id,
            queue=QUEUE_OF[stage],
            priority=celery_priority(job_priority),
            countdown=countdown_s or None,
            retry=True,
            retry_policy={"max_retries": 3, "interval_start": 0.5, "interval_step": 1.0},
        )
        return True
    except Exception:  # noqa: BLE001 - the run stays queued; the reconciler sends it again
        log.warning("run %s: could not publish %s; left queued for the reconciler", run_id, stage.value,
                    exc_info=True)
        return False


def advance(sessions: sessionmaker[Session], settings: Settings, job_id: int) -> Step:
    """Record the job's next step and, when an attempt is ready, send it to its queue."""
    task_id = str(uuid.uuid4())
    with session_scope(sessions) as session:
        step = advance_job(
            session, job_id, max_attempts=settings.max_attempts, retry_base_s=settings.retry_base_s,
            task_id=task_id,
        )
        priority = session.get_one(Job, job_id).priority
    if step.kind is StepKind.RUN:
        assert step.stage is not None and step.run_id is not None
        send(step.stage, step.run_id, task_id, priority, step.delay_s)
        log.info("job %s: sent %s (run %s)", job_id, step.stage.value, step.run_id)
    return step


def resend(sessions: sessionmaker[Session], run_id: int, countdown_s: float = 0.0) -> bool:
    """Send a queued attempt again under a new task id (its old message is gone or spent)."""
    task_id = str(uuid.uuid4())
    with session_scope(sessions) as session:
        run = session.get_one(StageRun, run_id)
        if run.status not in (StageState.PENDING.value, StageState.QUEUED.value):
            return False
        repo.set_stage_state(session, run, StageState.QUEUED, task_id=task_id)
        stage, priority = StageName(run.stage), run.job.priority
    return send(stage, run_id, task_id, priority, countdown_s)


def join(rt: Runtime, settings: Settings, parent_id: int, job_id: int) -> None:
    """A shard child finished: send retried shards, or move the job on once the parent is final."""
    outcome = join_parent(rt, parent_id)
    for run_id in outcome.retry_run_ids:
        resend(rt.sessions, run_id, countdown_s=settings.retry_base_s)
    if outcome.parent_state is not None and outcome.parent_state.is_final:
        advance(rt.sessions, settings, job_id)

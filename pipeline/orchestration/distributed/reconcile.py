"""Find work whose message or worker was lost and put it back on track.

Run by `bonsai reconcile` (once, or every N seconds). Each pass:
1. running attempts with a stale heartbeat are recorded as failed ("worker lost", retryable);
   the job then gets its next attempt, or fails once the attempt limit is reached (a lost
   shard child is retried by its parent's join instead); parents whose shard children all
   finished without a join are joined;
2. queued attempts whose message is lost are sent again under a new task id: gone from the
   broker (a restarted Redis, a send that failed), or delivered to a consumer that no live
   worker is (a worker killed after taking it: see `broker_view.is_orphaned`);
3. jobs that are pending or running with nothing queued (a crash between recording a
   result and sending the next stage) are advanced;
4. waiting attempts are admitted into the slots that are free.
Every step is idempotent, so passes may overlap with workers and with each other.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, or_, select
from sqlalchemy.orm import aliased

from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageState
from pipeline.db import repo
from pipeline.db.models import Job, StageRun, utcnow
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed.broker_view import BrokerView, is_orphaned, read_broker
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.progression import WORKER_LOST
from pipeline.orchestration.runtime import Runtime

__all__ = ["ReconcileReport", "reconcile", "broker_view"]

log = logging.getLogger(__name__)


@dataclass
class ReconcileReport:
    lost_runs: list[int] = field(default_factory=list)
    resent_runs: list[int] = field(default_factory=list)
    advanced_jobs: list[int] = field(default_factory=list)
    joined_runs: list[int] = field(default_factory=list)
    admitted_runs: list[int] = field(default_factory=list)

    def as_dict(self) -> dict[str, list[int]]:
        return {"lost_runs": self.lost_runs, "resent_runs": self.resent_runs,
                "advanced_jobs": self.advanced_jobs, "joined_runs": self.joined_runs,
                "admitted_runs": self.admitted_runs}


def broker_view(dispatcher: Dispatcher) -> BrokerView | None:
    """The broker's waiting and delivered-unacked messages; None when they cannot be listed."""
    try:
        with dispatcher.broker_connection() as connection:
            return read_broker(connection)
    except Exception:  # noqa: BLE001 - not Redis, or unreachable: fall back to age alone
        log.warning("could not list the broker's messages; re-sending by age only", exc_info=True)
        return None


_ACTIVE = (StageState.PENDING, StageState.QUEUED, StageState.RUNNING)


def _children(active: bool | None = None) -> Any:
    """EXISTS over a run's shard children (all of them, or only active/finished ones)."""
    child = aliased(StageRun)
    query = select(child.id).where(child.parent_run_id == StageRun.id)
    if active is True:
        query = query.where(child.status.in_(_ACTIVE))
    elif active is False:
        query = query.where(child.status.not_in(_ACTIVE))
    return query.exists()


def _mark_lost(rt: Runtime, settings: Settings, report: ReconcileReport) -> None:
    sessions = rt.sessions
    cutoff = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s)
    with session_scope(sessions) as session:
        stale = session.scalars(
            select(StageRun)
            # A parent waiting on its shards does not beat: its children do, and a parent whose
            # children all finished is joined (below), never declared lost.
            .where(StageRun.status == StageState.RUNNING, StageRun.heartbeat_at < cutoff,
                   ~_children())
            .with_for_update(skip_locked=True)
        ).all()
        for run in stale:
            silent_s = (utcnow() - run.heartbeat_at).total_seconds() if run.heartbeat_at else None
            repo.set_stage_state(
                session, run, StageState.FAILED, error_kind="retryable",
                error_message=f"{WORKER_LOST}: no heartbeat from {run.worker_host} for {silent_s:.0f}s",
            )
            report.lost_runs.append(run.id)
            log.warning("job %s stage %s: attempt %s lost (worker %s)", run.job_id, run.stage, run.attempt,
                        run.worker_host)
        lost_children = sorted({(run.parent_run_id, run.job_id) for run in stale if run.parent_run_id})
        lost_jobs = sorted({run.job_id for run in stale if not run.parent_run_id})
    for parent_id, job_id in lost_children:
        Dispatcher.of(rt).after_shard(rt, parent_id, job_id)
    for job_id in lost_jobs:
        Dispatcher.of(rt).advance(job_id)


def _join_finished_parents(rt: Runtime, settings: Settings, report: ReconcileReport) -> None:
    """Parents whose shards all finished but whose join never ran (its worker died first)."""
    with session_scope(rt.sessions) as session:
        parents = session.execute(
            select(StageRun.id, StageRun.job_id).where(
                StageRun.status == StageState.RUNNING, _children(), ~_children(active=True)
            )
        ).all()
    for parent_id, job_id in parents:
        Dispatcher.of(rt).after_shard(rt, parent_id, job_id)
        report.joined_runs.append(parent_id)


def _resend_orphans(rt: Runtime, settings: Settings, report: ReconcileReport) -> None:
    dispatcher = Dispatcher.of(rt)
    cutoff = utcnow() - timedelta(seconds=settings.requeue_after_s)
    with session_scope(rt.sessions) as session:
        queued = session.scalars(
            select(StageRun).where(
                or_(
                    and_(StageRun.status == StageState.QUEUED, StageRun.queued_at < cutoff),
                    # Shard children are sent right after they are recorded; a crash between leaves them.
                    and_(StageRun.status == StageState.PENDING, StageRun.parent_run_id.is_not(None),
                         StageRun.created_at < cutoff),
                )
            )
        ).all()
        candidates = [(run.id, run.task_id) for run in queued]
    if not candidates:
        return
    view = broker_view(dispatcher)
    since = utcnow() - timedelta(seconds=settings.heartbeat_timeout_s)
    with session_scope(rt.sessions) as session:
        held = {task for worker in repo.live_workers(session, since) for task in worker.held_task_ids}
    now_s = time.time()
    for run_id, task_id in candidates:
        # A message delivered to a worker that is gone stays "unacked" for hours: send it again.
        if not is_orphaned(task_id, view, held, now_s, settings.heartbeat_timeout_s):
            continue
        if dispatcher.resend(run_id):
            report.resent_runs.append(run_id)


def _advance_idle_jobs(rt: Runtime, report: ReconcileReport) -> None:
    active = (StageState.QUEUED, StageState.RUNNING)
    with session_scope(rt.sessions) as session:
        # A job whose ready attempt waits for admission is not idle: the admission below serves it.
        busy = select(StageRun.job_id).where(or_(
            StageRun.status.in_(active),
            and_(StageRun.status == StageState.PENDING, StageRun.ready_at.is_not(None))))
        idle = session.scalars(
            select(Job.id).where(
                Job.status.in_((JobState.PENDING, JobState.RUNNING)), Job.id.not_in(busy)
            )
        ).all()
    for job_id in idle:
        Dispatcher.of(rt).advance(job_id)
        report.advanced_jobs.append(job_id)


def reconcile(rt: Runtime, settings: Settings) -> ReconcileReport:
    """One pass over the database; see the module docstring."""
    report = ReconcileReport()
    _mark_lost(rt, settings, report)
    _join_finished_parents(rt, settings, report)
    _resend_orphans(rt, settings, report)
    _advance_idle_jobs(rt, report)
    report.admitted_runs.extend(Dispatcher.of(rt).admit())
    return report

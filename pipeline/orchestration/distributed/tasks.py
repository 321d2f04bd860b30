"""One thin task per stage: claim and run the attempt, then ask dispatch for the next step."""

from __future__ import annotations

import logging

from celery import Celery

from pipeline.core.states import StageName, StageState
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed import worker_process
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.queues import TIME_LIMITS_S, task_name

__all__ = ["run_stage_run", "register_tasks"]

log = logging.getLogger(__name__)

_DEFER_S = 2.0


def run_stage_run(run_id: int) -> str:
    """The body every stage task shares; returns the run's state for the worker log."""
    rt = worker_process.runtime()
    dispatcher = worker_process.dispatcher()
    state = execute_run(rt, run_id)
    with session_scope(rt.sessions) as session:
        run = session.get_one(StageRun, run_id)
        job_id, parent_id = run.job_id, run.parent_run_id
    if state in (StageState.PENDING, StageState.QUEUED):
        # An equal run is in flight elsewhere; look again shortly and reuse its result.
        dispatcher.resend(run_id, countdown_s=_DEFER_S)
    elif parent_id is not None and state.is_final:
        dispatcher.after_shard(rt, parent_id, job_id)
    elif state.is_final:
        # Idempotent: a duplicate delivery finds the next stage already queued and waits.
        dispatcher.advance(job_id)
    return state.value


def register_tasks(app: Celery) -> None:
    """Register ``stage.<name>`` for every stage on `app`, each with its time limits."""
    for stage in StageName:
        soft_s, hard_s = TIME_LIMITS_S[stage]
        app.task(name=task_name(stage), soft_time_limit=soft_s, time_limit=hard_s,
                 ignore_result=True)(run_stage_run)

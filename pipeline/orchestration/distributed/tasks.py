"""One thin task per stage: claim and run the attempt, then ask dispatch for the next step."""

from __future__ import annotations

import logging
from typing import Any

from billiard.exceptions import WorkerLostError
from celery import Celery
from celery.worker.request import Request
from sqlalchemy import select

from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed import worker_process
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.progression import WORKER_LOST
from pipeline.orchestration.queues import TIME_LIMITS_S, task_name
from pipeline.orchestration.store_gc import release_source

__all__ = ["run_stage_run", "register_tasks", "StageRequest"]

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
        if dispatcher.advance(job_id).final is JobState.SUCCEEDED:
            release_source(rt.sessions, rt.store, job_id)
    return state.value


class StageRequest(Request):  # type: ignore[misc]
    """Celery's request, plus: a pool process that died mid-attempt is recorded at once.

    Runs in the worker's main process. Without this the attempt would look alive until its
    heartbeat went stale; with it, "killed by SIGKILL" (what the kernel's out-of-memory killer
    sends) is on the row within a second and the job moves on to its next attempt.
    """

    def on_failure(self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False) -> Any:
        exc = getattr(exc_info, "exception", None)
        exc = getattr(exc, "exc", exc)
        if isinstance(exc, WorkerLostError) and self.args:
            try:
                _record_lost_process(int(self.args[0]), str(exc))
            except Exception:  # noqa: BLE001 - the reconciler still finds it by its silent heartbeat
                log.warning("run %s: could not record its lost process", self.args[0], exc_info=True)
        return super().on_failure(exc_info, send_failed_event=send_failed_event, return_ok=return_ok)


def _record_lost_process(run_id: int, why: str) -> None:
    rt = worker_process.runtime()
    signal_name = "SIGKILL" if "SIGKILL" in why or "signal 9" in why else why
    with session_scope(rt.sessions) as session:
        run = session.execute(select(StageRun).where(StageRun.id == run_id).with_for_update()).scalar_one()
        job_id, parent_id = run.job_id, run.parent_run_id
        if run.status != StageState.RUNNING:
            return  # already recorded (the memory guard writes its reason before it kills)
        repo.set_stage_state(
            session, run, StageState.FAILED, error_kind="retryable",
            error_message=f"{WORKER_LOST}: the stage's process on {run.worker_host} was killed "
            f"({signal_name}); when nothing else killed it, the kernel's out-of-memory killer did: "
            "give the worker more memory, or set BONSAI_WORKER_MEMORY_MB so the pipeline stops it first",
        )
    dispatcher = worker_process.dispatcher()
    if parent_id is not None:
        dispatcher.after_shard(rt, parent_id, job_id)
    else:
        dispatcher.advance(job_id)


def register_tasks(app: Celery) -> None:
    """Register ``stage.<name>`` for every stage on `app`, each with its time limits."""
    for stage in StageName:
        soft_s, hard_s = TIME_LIMITS_S[stage]
        app.task(name=task_name(stage), soft_time_limit=soft_s, time_limit=hard_s,
                 ignore_result=True, Request=StageRequest)(run_stage_run)

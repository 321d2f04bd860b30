"""The only place that enqueues work: record the next attempt as queued, then send it.

Ready attempts wait in the database until admission (`admission.admit_attempts`) gives them a slot.

The row is committed (with its task id) before the message is sent. If sending
fails, the attempt stays queued and the reconciler sends it again later; if the
message is delivered twice, the atomic claim makes the second delivery a no-op.
"""

from __future__ import annotations

import logging
import uuid
from datetime import datetime, timedelta
from typing import TYPE_CHECKING, Any

from sqlalchemy.orm import Session, sessionmaker

from pipeline.core.settings import Settings
from pipeline.core.states import StageName, StageState
from pipeline.core.teams import load_teams
from pipeline.db import repo
from pipeline.db.models import StageRun, utcnow
from pipeline.db.session import session_scope
from pipeline.orchestration.admission import admit_attempts
from pipeline.orchestration.execution import join_shards
from pipeline.orchestration.progression import Advance, advance_job
from pipeline.orchestration.queues import QUEUE_OF, task_name

if TYPE_CHECKING:
    from celery import Celery

    from pipeline.orchestration.runtime import Runtime

__all__ = ["Dispatcher"]

log = logging.getLogger(__name__)


class Dispatcher:
    """Sends attempts to the broker for one database and one Celery app."""

    def __init__(
        self, sessions: sessionmaker[Session], settings: Settings, app: Celery | None = None
    ) -> None:
        self.sessions, self.settings = sessions, settings
        self.teams = load_teams(settings.teams_file)
        self._app = app

    @classmethod
    def of(cls, rt: Runtime) -> Dispatcher:
        """The dispatcher of a distributed runtime (its launcher's)."""
        dispatcher = getattr(rt.launcher, "dispatcher", None)
        if not isinstance(dispatcher, Dispatcher):
            raise ValueError("this runtime is embedded: it has no broker to dispatch to")
        return dispatcher

    @property
    def app(self) -> Celery:
        if self._app is None:
            from pipeline.orchestration.distributed.celery_app import app_for

            self._app = app_for(self.settings)
        return self._app

    def send(self, stage: StageName, run_id: int, task_id: str, countdown_s: float = 0.0) -> bool:
        """Publish "run stage run `run_id`"; False when the broker could not take it.

        Every message goes at one broker priority: admission already chose what runs first, and a
        broker priority reaches across queues (Redis serves a higher one from any queue first), so a
        high-priority flood would again starve another team's admitted work."""
        try:
            self.app.send_task(
                task_name(stage),
                args=[run_id],
                task_id=task_id,
                queue=QUEUE_OF[stage],
                countdown=countdown_s or None,
                retry=True,
                retry_policy={"max_retries": 3, "interval_start": 0.5, "interval_step": 1.0},
            )
            return True
        except Exception:  # noqa: BLE001 - the run stays queued; the reconciler sends it again
            log.warning("run %s: could not publish %s; left queued for the reconciler", run_id, stage.value,
                        exc_info=True)
            return False

    def advance(self, job_id: int) -> Advance:
        """Record the job's next steps: every attempt that is ready waits for admission (a retry after
        its backoff is sent at once, continuing admitted work); then admit what the free slots take."""
        with session_scope(self.sessions) as session:
            outcome = advance_job(session, job_id, max_attempts=self.settings.max_attempts,
                                  retry_base_s=self.settings.retry_base_s, spare_workers=True,
                                  workers_since=self._workers_since())
            now = utcnow()
            for step in outcome.ready:
                run = session.get_one(StageRun, step.run_id)
                if not step.delay_s and run.ready_at is None:
                    run.ready_at = now
        for step in outcome.ready:
            if step.delay_s:
                self.resend(step.run_id, countdown_s=step.delay_s)
        self.admit()
        return outcome

    def admit(self) -> list[int]:
        """Send the waiting attempts that the fair-share chooser admits into free slots; their run ids.
        A failure to admit (the database gone for a moment) leaves them waiting for the reconciler."""
        try:
            with session_scope(self.sessions) as session:
                admitted, _why = admit_attempts(session, self.teams, self._workers_since())
        except Exception:  # noqa: BLE001 - the rows are unchanged: the next admission takes them
            log.warning("admission failed; the waiting attempts stay pending for the next one", exc_info=True)
            return []
        for item in admitted:
            self.send(item.stage, item.run_id, item.task_id)
            log.info("run %s: admitted and sent %s", item.run_id, item.stage.value)
        return [item.run_id for item in admitted]

    def _workers_since(self) -> datetime:
        return utcnow() - timedelta(seconds=self.settings.heartbeat_timeout_s)

    def resend(self, run_id: int, countdown_s: float = 0.0) -> bool:
        """Send a queued attempt again under a new task id (its old message is gone or spent)."""
        task_id = str(uuid.uuid4())
        with session_scope(self.sessions) as session:
            run = session.get_one(StageRun, run_id)
            if run.status not in (StageState.PENDING, StageState.QUEUED):
                return False
            repo.set_stage_state(session, run, StageState.QUEUED, task_id=task_id)
            stage = run.stage
        return self.send(stage, run_id, task_id, countdown_s)

    def send_runs(self, run_ids: list[int]) -> None:
        """Send freshly recorded attempts (shard children) to their queues."""
        for run_id in run_ids:
            self.resend(run_id)

    def after_shard(self, rt: Runtime, parent_id: int, job_id: int) -> None:
        """A shard child finished: send retried shards, or move the job on once the parent is final."""
        outcome = join_shards(rt, parent_id)
        for run_id in outcome.retry_run_ids:
            self.resend(run_id, countdown_s=self.settings.retry_base_s)
        if outcome.parent_state is not None and outcome.parent_state.is_final:
            self.advance(job_id)
        else:
            self.admit()  # the shard's slot is free

    def revoke(self, task_ids: list[str]) -> None:
        """Stop running tasks (a cancelled job's)."""
        if task_ids:
            self.app.control.revoke(task_ids, terminate=True, signal="SIGTERM")

    def broker_connection(self) -> Any:
        return self.app.connection_for_read()

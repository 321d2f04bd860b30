"""The two ways recorded jobs get run, chosen once in `bootstrap.build_runtime`.

`EmbeddedLauncher` runs jobs one at a time on a background thread of this process, through
the same `embedded.run_job` loop that `bonsai convert` uses (one at a time keeps SQLite to
one writer and the CPU to one conversion), the next one chosen by fair share among teams.
`CeleryLauncher` hands each job's next stage to
the workers through the dispatcher. The CLI and the API call `submit_jobs` and `launcher.start`
and never ask which one they have.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from concurrent.futures import Future

from pipeline.core.settings import Settings
from pipeline.db.session import session_scope
from pipeline.orchestration.admission import next_job
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.orchestration.runtime import Launcher, Runtime
from pipeline.stages.sources import SourcePolicy

__all__ = ["EmbeddedLauncher", "CeleryLauncher", "submit_jobs"]

log = logging.getLogger(__name__)


class EmbeddedLauncher:
    """Runs jobs in this process, one at a time, on a thread started on first use; when it frees, the
    fair-share chooser (`fair_share.choose`, as the distributed dispatcher's) picks the next job."""

    is_embedded = True

    def __init__(self, rt: Runtime, settings: Settings) -> None:
        self._rt, self._settings = rt, settings
        self._changed = threading.Condition()
        self._waiting: dict[int, Future[None]] = {}
        self._futures: dict[int, Future[None]] = {}
        # A shutdown ends the thread of its generation; a later start begins the next one.
        self._generation = 0
        self._thread: threading.Thread | None = None

    def start(self, job_id: int) -> None:
        with self._changed:
            if job_id not in self._waiting:  # a job waiting already runs all its remaining stages
                self._waiting[job_id] = self._futures[job_id] = Future()
            if self._thread is None:
                self._thread = threading.Thread(target=self._serve, args=(self._generation,),
                                                name="bonsai-job", daemon=True)
                self._thread.start()
            self._changed.notify_all()

    def revoke(self, task_ids: Sequence[str]) -> None:
        """Nothing to revoke: an embedded run checks its rows and stops by itself."""

    def wait(self, job_id: int, timeout_s: float | None = None) -> None:
        """Block until the background run of `job_id` ends (tests and shutdown)."""
        future = self._futures.get(job_id)
        if future is not None:
            future.result(timeout=timeout_s)

    def shutdown(self) -> None:
        with self._changed:
            # Waiting jobs stay pending in the database; the one running finishes its stage.
            for future in self._waiting.values():
                future.cancel()
            self._waiting.clear()
            # An app started again (a new ASGI lifespan) gets a new thread.
            self._generation += 1
            self._thread = None
            self._changed.notify_all()

    def _serve(self, generation: int) -> None:
        while True:
            with self._changed:
                while not self._waiting and generation == self._generation:
                    self._changed.wait()
                if generation != self._generation:
                    return
                job_id = self._next(list(self._waiting))
                future = self._waiting.pop(job_id)
            if future.set_running_or_notify_cancel():
                self._run(job_id)
                future.set_result(None)

    def _next(self, job_ids: list[int]) -> int:
        """The waiting job the chooser gives the one slot (the oldest if the rows cannot be read)."""
        try:
            with session_scope(self._rt.sessions) as session:
                return next_job(session, job_ids, self._rt.teams)
        except Exception:  # noqa: BLE001 - a database hiccup must not stop the runner; order is the only loss
            log.warning("choosing the next job failed; running the oldest", exc_info=True)
            return min(job_ids)

    def _run(self, job_id: int) -> None:
        from pipeline.orchestration.embedded import run_job

        try:
            state = run_job(self._rt, job_id)
            log.info("job %s: embedded run ended %s", job_id, state.value)
        except Exception:  # noqa: BLE001 - a thread has no caller to raise to; the rows tell the rest
            log.exception("job %s: embedded run stopped", job_id)
        if self._settings.signing_key is not None:
            self._sign(job_id)

    def _sign(self, job_id: int) -> None:
        from pipeline.provenance.signing import load_private_key, sign_pending

        try:
            key = load_private_key(self._settings.signing_key)  # type: ignore[arg-type]
            with session_scope(self._rt.sessions) as session:
                count = sign_pending(session, self._rt.store, key, job_id)
            log.info("job %s: %s statement(s) signed", job_id, count)
        except Exception:  # noqa: BLE001 - unsigned statements show up in `bonsai audit`
            log.exception("job %s: statements not signed", job_id)


class CeleryLauncher:
    """Sends each job's next stage to the workers' queues; the Celery app is built on first send."""

    is_embedded = False

    def __init__(self, dispatcher: Dispatcher) -> None:
        self.dispatcher = dispatcher

    def start(self, job_id: int) -> None:
        self.dispatcher.advance(job_id)

    def revoke(self, task_ids: Sequence[str]) -> None:
        self.dispatcher.revoke(list(task_ids))
        self.dispatcher.admit()  # the cancelled job's slots go to work waiting for one

    def shutdown(self) -> None:
        """Nothing runs here: workers keep going."""


def submit_jobs(
    rt: Runtime, requests: Sequence[JobRequest], submitted_by: str | None, policy: SourcePolicy,
    *, team: str | None = None, may_exceed_priority: bool = False,
) -> list[int]:
    """Record every job first (one transaction, checked before any row exists, the team's caps
    included), then start them.

    A crash between the two leaves pending jobs that the reconciler (or a retry) starts.
    """
    launcher: Launcher | None = rt.launcher
    if launcher is None:
        raise ValueError("this runtime has no launcher; build it with bootstrap.build_runtime")
    with session_scope(rt.sessions) as session:
        job_ids = create_jobs(session, requests, submitted_by, policy, team=team, teams=rt.teams,
                              may_exceed_priority=may_exceed_priority)
    for job_id in job_ids:
        launcher.start(job_id)
    return job_ids

"""The two ways recorded jobs get run, chosen once in `bootstrap.build_runtime`.

`EmbeddedLauncher` runs jobs one at a time on a background thread of this process, through
the same `embedded.run_job` loop that `bonsai convert` uses (one at a time keeps SQLite to
one writer and the CPU to one conversion). `CeleryLauncher` hands each job's next stage to
the workers through the dispatcher. The CLI and the API call `submit_jobs` and `launcher.start`
and never ask which one they have.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.core.settings import Settings
from pipeline.db.session import session_scope
from pipeline.orchestration.distributed.dispatch import Dispatcher
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.orchestration.runtime import Launcher, Runtime
from pipeline.stages.sources import SourcePolicy

__all__ = ["EmbeddedLauncher", "CeleryLauncher", "submit_jobs"]

log = logging.getLogger(__name__)


class EmbeddedLauncher:
    """Runs jobs in this process, one at a time, on a thread started on first use."""

    is_embedded = True

    def __init__(self, rt: Runtime, settings: Settings) -> None:
        self._rt, self._settings = rt, settings
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[int, Future[None]] = {}

    def start(self, job_id: int) -> None:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bonsai-job")
        self._futures[job_id] = self._pool.submit(self._run, job_id)

    def revoke(self, task_ids: Sequence[str]) -> None:
        """Nothing to revoke: an embedded run checks its rows and stops by itself."""

    def wait(self, job_id: int, timeout_s: float | None = None) -> None:
        """Block until the background run of `job_id` ends (tests and shutdown)."""
        future = self._futures.get(job_id)
        if future is not None:
            future.result(timeout=timeout_s)

    def shutdown(self) -> None:
        if self._pool is not None:
            # Queued jobs stay pending in the database; the one running finishes its stage.
            self._pool.shutdown(wait=False, cancel_futures=True)
            # An app started again (a new ASGI lifespan) gets a new thread, not a dead pool's error.
            self._pool = None

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

    def shutdown(self) -> None:
        """Nothing runs here: workers keep going."""


def submit_jobs(
    rt: Runtime, requests: Sequence[JobRequest], submitted_by: str | None, policy: SourcePolicy
) -> list[int]:
    """Record every job first (one transaction, checked before any row exists), then start them.

    A crash between the two leaves pending jobs that the reconciler (or a retry) starts.
    """
    launcher: Launcher | None = rt.launcher
    if launcher is None:
        raise ValueError("this runtime has no launcher; build it with bootstrap.build_runtime")
    with session_scope(rt.sessions) as session:
        job_ids = create_jobs(session, requests, submitted_by, policy)
    for job_id in job_ids:
        launcher.start(job_id)
    return job_ids

"""Start recorded jobs from the API: a background thread (embedded) or the broker (distributed).

Embedded mode runs jobs one at a time on a single thread of the API process, through
the same `pipeline.orchestration.embedded.run_job` loop that `bonsai convert` uses; running them one
at a time keeps SQLite to one writer and the CPU to one conversion. Distributed mode
records the jobs and hands their first stages to the workers, exactly like `bonsai submit`.
Celery is imported only in distributed mode.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor

from pipeline.core.settings import Settings
from pipeline.db.session import session_scope
from pipeline.orchestration.execution import Runtime
from pipeline.orchestration.job_control import JobRequest, create_jobs

__all__ = ["JobRunner"]

log = logging.getLogger(__name__)


class JobRunner:
    """Owns the embedded job thread; in distributed mode a thin front for the Celery dispatch."""

    def __init__(self, settings: Settings, rt: Runtime) -> None:
        self.settings, self.rt = settings, rt
        self._pool: ThreadPoolExecutor | None = None
        self._futures: dict[int, Future[None]] = {}
        if settings.is_embedded:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="bonsai-job")

    def submit(self, requests: Sequence[JobRequest], submitted_by: str) -> list[int]:
        """Record the jobs and start them; returns their ids."""
        if not self.settings.is_embedded:
            from pipeline.orchestration.distributed.submit import submit_jobs

            return submit_jobs(self.rt, self.settings, requests, submitted_by)
        with session_scope(self.rt.sessions) as session:
            job_ids = create_jobs(session, requests, submitted_by)
        for job_id in job_ids:
            self.start(job_id)
        return job_ids

    def start(self, job_id: int) -> None:
        """Run (embedded) or dispatch (distributed) the job's remaining stages, e.g. after a retry."""
        if self._pool is None:
            from pipeline.orchestration.distributed.dispatch import advance

            advance(self.rt.sessions, self.settings, job_id)
            return
        self._futures[job_id] = self._pool.submit(self._run, job_id)

    def revoke(self, task_ids: Sequence[str]) -> None:
        """Stop running tasks of a cancelled job (distributed); embedded runs notice by themselves."""
        if task_ids and self._pool is None:
            from pipeline.orchestration.distributed.celery_app import app

            app.control.revoke(list(task_ids), terminate=True, signal="SIGTERM")

    def wait(self, job_id: int, timeout_s: float | None = None) -> None:
        """Block until the embedded run of `job_id` ends (tests and shutdown)."""
        future = self._futures.get(job_id)
        if future is not None:
            future.result(timeout=timeout_s)

    def shutdown(self) -> None:
        if self._pool is not None:
            # Queued jobs stay pending in the database; the one running finishes its stage.
            self._pool.shutdown(wait=False, cancel_futures=True)

    def _run(self, job_id: int) -> None:
        from pipeline.orchestration.embedded import run_job

        try:
            state = run_job(self.rt, job_id)
            log.info("job %s: embedded run ended %s", job_id, state.value)
        except Exception:  # noqa: BLE001 - a thread has no caller to raise to; the rows tell the rest
            log.exception("job %s: embedded run stopped", job_id)
        if self.settings.signing_key is not None:
            self._sign(job_id)

    def _sign(self, job_id: int) -> None:
        from pipeline.provenance.signing import load_private_key, sign_pending

        try:
            key = load_private_key(self.settings.signing_key)  # type: ignore[arg-type]
            with session_scope(self.rt.sessions) as session:
                count = sign_pending(session, self.rt.store, key, job_id)
            log.info("job %s: %s statement(s) signed", job_id, count)
        except Exception:  # noqa: BLE001 - unsigned statements show up in `bonsai audit`
            log.exception("job %s: statements not signed", job_id)

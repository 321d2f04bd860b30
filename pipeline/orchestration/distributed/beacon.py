"""A worker's heartbeat row: who it is, which queues it serves, which task ids it holds right now.

Started in the worker's main process when Celery says it is ready, stamped every few seconds
by a thread, marked stopped on a warm shutdown. The held ids are what Celery's own
``inspect active/reserved`` would report (the main process's request registries), read locally
instead of by broadcast, so a slow or dead worker cannot stall the reconciler.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from collections.abc import Sequence

from sqlalchemy.orm import Session, sessionmaker

from pipeline.db import repo
from pipeline.db.session import session_scope

__all__ = ["WorkerBeacon", "held_task_ids"]

log = logging.getLogger(__name__)


def held_task_ids() -> list[str]:
    """Task ids this worker process has reserved (prefetched) or is running."""
    from celery.worker import state

    requests = [*list(state.reserved_requests), *list(state.active_requests)]
    return sorted({str(request.id) for request in requests if getattr(request, "id", None)})


class WorkerBeacon:
    """Keeps this worker's row fresh until `stop`."""

    def __init__(self, sessions: sessionmaker[Session], name: str, queues: Sequence[str], concurrency: int,
                 interval_s: float, memory_limit_mb: int | None = None) -> None:
        self._sessions, self.name, self._memory_limit_mb = sessions, name, memory_limit_mb
        self._queues, self._concurrency, self._interval_s = list(queues), concurrency, interval_s
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="worker-beacon", daemon=True)

    def start(self) -> None:
        with session_scope(self._sessions) as session:
            repo.worker_started(session, self.name, socket.gethostname(), os.getpid(), self._queues,
                                self._concurrency, self._memory_limit_mb)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=self._interval_s * 2)
        try:
            with session_scope(self._sessions) as session:
                repo.worker_stopped(session, self.name)
        except Exception:  # noqa: BLE001 - the row then simply goes stale, as a crash would leave it
            log.warning("worker %s: could not record its stop", self.name, exc_info=True)

    def _loop(self) -> None:
        while not self._stop.wait(self._interval_s):
            try:
                with session_scope(self._sessions) as session:
                    repo.worker_beat(session, self.name, held_task_ids())
            except Exception:  # noqa: BLE001 - a missed beat (database restarting) is not fatal
                log.warning("worker %s: heartbeat not recorded", self.name, exc_info=True)

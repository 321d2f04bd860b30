"""A running attempt stamps its row every few seconds; the reconciler treats silence as a dead worker."""

from __future__ import annotations

import logging
import threading

from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.runtime import Runtime

__all__ = ["Heartbeat"]

log = logging.getLogger(__name__)


class Heartbeat:
    """Stamps the run as alive every `rt.heartbeat_s` seconds while the stage works."""

    def __init__(self, rt: Runtime, run_id: int) -> None:
        self._rt, self._run_id = rt, run_id
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"heartbeat-{run_id}", daemon=True)

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(self, *_exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _beat(self) -> None:
        while not self._stop.wait(self._rt.heartbeat_s):
            try:
                with session_scope(self._rt.sessions) as session:
                    repo.touch_heartbeat(session, self._run_id)
            except Exception:  # noqa: BLE001 - a missed beat (database restarting) is not fatal
                log.warning("run %s: heartbeat not recorded", self._run_id, exc_info=True)

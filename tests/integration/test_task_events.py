"""Monitoring a real cluster: task events (what Flower shows), a quiet cancel, `status` in a pipe."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from pipeline.orchestration.distributed.celery_app import make_app
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.services, pytest.mark.slow]

HOLD_DECOMPOSE = {"BONSAI_STAGE_PACKAGE": "tests.support.fault_stages",
                  "BONSAI_TEST_DECOMPOSE_FAULT": "delay:60"}


@pytest.fixture
def cluster(pg_url: str, broker_url: str, tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path / "home", pg_url, broker_url)
    made.home.mkdir()
    assert made.bonsai("db", "upgrade").returncode == 0
    yield made
    made.stop()


class EventLog:
    """Every task event on the broker, received the way Flower receives them."""

    def __init__(self, broker_url: str) -> None:
        self.events: list[dict[str, Any]] = []
        self._app = make_app(broker_url)
        self._connection = self._app.connection_for_read()
        self._receiver = self._app.events.Receiver(self._connection, handlers={"*": self.events.append})
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        # One subscription for the whole test: a capture that times out unsubscribes, and Redis
        # drops what is published before the next one subscribes. Without a timeout it checks
        # should_stop once a second.
        self._receiver.capture(limit=None, timeout=None, wakeup=False)

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [event for event in self.events if event.get("type") == kind]

    def workers(self) -> set[str]:
        """Hostnames of the workers that announced themselves (online, or a heartbeat)."""
        announced = self.of("worker-online") + self.of("worker-heartbeat")
        return {str(event.get("hostname")) for event in announced}

    def close(self) -> None:
        self._receiver.should_stop = True
        self._thread.join(timeout=5)
        self._connection.release()


def test_tasks_are_visible_and_cancel_logs_no_backend_error(cluster: Cluster, broker_url: str,
                                                            demo_checkpoint: Path) -> None:
    cluster.extra_env.update(HOLD_DECOMPOSE)  # decompose waits: the cancel lands while it runs
    events = EventLog(broker_url)
    try:
        cluster.start_worker()
        cluster.start_worker()  # idle: a revoke broadcast reaches it too
        cluster.wait_for(lambda: len(events.workers()) >= 2, 120, "both workers to announce themselves")
        (job_id,) = cluster.submit(str(demo_checkpoint))
        cluster.wait_for(lambda: any(r.status == "running" for r in cluster.runs(stage="decompose")), 180,
                         "decompose to start")
        cancelled = cluster.bonsai("cancel", str(job_id))
        assert cancelled.returncode == 0, cancelled.stderr
        cluster.wait_for(lambda: bool(events.of("task-revoked")), 30, "the revoked task's event")
    finally:
        events.close()
    names = {event.get("name") for event in events.of("task-received")}
    assert {"stage.download", "stage.checksum", "stage.inspect", "stage.decompose"} <= names
    assert len(events.of("task-succeeded")) >= 3  # download, checksum, inspect
    assert events.of("task-sent"), "senders announce tasks too"
    cluster.stop()
    logs = "".join((cluster.home / f"worker{i}.log").read_text(errors="replace") for i in (0, 1))
    assert "No result backend" not in logs
    assert "Failed to mark task" not in logs
    assert "Terminating" in logs  # the holder stopped the attempt


def test_status_warns_about_a_queue_no_live_worker_serves(cluster: Cluster, demo_checkpoint: Path) -> None:
    cluster.start_worker(queues="io")  # download and checksum run; inspect (cpu) has nobody
    (job_id,) = cluster.submit(str(demo_checkpoint))
    cluster.wait_for(lambda: any(r.status == "queued" for r in cluster.runs(stage="inspect")), 120,
                     "inspect to be queued")
    shown = cluster.bonsai("status", str(job_id))
    assert shown.returncode == 0, shown.stderr
    assert f"job {job_id} running inspect (attempt 1)" in shown.stdout  # a pipe gets plain lines
    assert f"job {job_id} waits on queue 'cpu', which no live worker serves" in shown.stderr
    assert "bonsai worker --queues cpu" in shown.stderr

    cluster.start_worker(queues="cpu,gpu")
    watched = cluster.bonsai("status", "--watch", "0.5", str(job_id), timeout_s=300)
    assert watched.returncode == 0, watched.stdout + watched.stderr  # it returns once the job is done
    assert watched.stdout.strip().splitlines()[-1].startswith(f"job {job_id} succeeded")

"""Faults a worker meets, on the real things: a message held by a consumer that died, a stage that eats
memory, a stage process the kernel kills. Every one ends with the job settled, and soon."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.cluster import Cluster

pytestmark = [pytest.mark.services, pytest.mark.slow]

FAULTS = "tests.support.fault_stages"

# A consumer that takes the next message off the gpu queue without acking it, says which, and
# dies on the spot: its message then sits in the broker's unacked set, "held", for hours.
_TAKE_AND_DIE = """
import os, signal, sys
from pipeline.orchestration.distributed.celery_app import make_app
app = make_app(sys.argv[1])
with app.connection_for_read() as connection:
    queue = connection.SimpleQueue("gpu", no_ack=False)
    message = queue.get(timeout=60)
    print(message.headers["id"], flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.fixture
def cluster(pg_url: str, broker_url: str, tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(tmp_path / "home", pg_url, broker_url)
    made.home.mkdir()
    assert made.bonsai("db", "upgrade").returncode == 0
    yield made
    made.stop()


def test_message_held_by_a_dead_consumer_is_sent_again(cluster: Cluster, demo_checkpoint: Path) -> None:
    """Finding 2 of issue 15: the run stayed queued behind a dead consumer until the visibility timeout."""
    cluster.start_worker(queues="io,cpu")
    cluster.start_reconciler(every_s=0.5)
    (job_id,) = cluster.submit(str(demo_checkpoint))
    # Decompose is a tq2_0 job's first gpu stage: calibrate waits for its verdict (issue 25).
    cluster.wait_for(lambda: any(r.status == "queued" for r in cluster.runs(stage="decompose")), 120,
                     "decompose (the first gpu stage) to be queued")
    taken = subprocess.run([sys.executable, "-c", _TAKE_AND_DIE, cluster.broker_url], capture_output=True,
                           text=True, timeout=90, cwd=Path(__file__).resolve().parents[2])
    held_task_id = taken.stdout.strip()
    (run,) = cluster.runs(stage="decompose")
    assert held_task_id == run.task_id, taken.stderr  # the dead consumer held exactly this run's message
    started = time.monotonic()
    cluster.start_worker(queues="gpu")
    assert cluster.wait_jobs_final([job_id], timeout_s=90) == {job_id: "succeeded"}
    # Recovered within the grace period (heartbeat timeout 3 s here), not the 13 h visibility timeout.
    assert time.monotonic() - started < 60
    (decompose,) = cluster.runs(stage="decompose")
    assert decompose.status == "succeeded" and decompose.attempt == 1
    assert decompose.task_id != held_task_id  # sent again under a new id; the old copy stays harmless


def test_live_workers_beat_with_the_tasks_they_hold(cluster: Cluster, demo_checkpoint: Path) -> None:
    from pipeline.db import repo
    from pipeline.db.session import session_scope

    cluster.extra_env.update(BONSAI_STAGE_PACKAGE=FAULTS, BONSAI_TEST_DECOMPOSE_FAULT="delay:3")
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint))
    cluster.wait_for(lambda: any(r.status == "running" for r in cluster.runs(stage="decompose")), 120,
                     "decompose to run")
    (run,) = cluster.runs(stage="decompose")

    def holds_it() -> bool:
        with session_scope(cluster.sessions) as session:
            return any(run.task_id in w.held_task_ids for w in repo.all_workers(session))

    cluster.wait_for(holds_it, 10, "the worker row to list the task it runs")
    with session_scope(cluster.sessions) as session:
        (worker,) = repo.all_workers(session)
        assert worker.name == "w0@" + worker.hostname and worker.queues == ["io", "cpu", "gpu"]
    listed = json.loads(cluster.bonsai("workers", "--json").stdout)
    assert [(w["name"], w["state"]) for w in listed["workers"]] == [(worker.name, "live")]
    assert listed["queues_without_live_worker"] == []
    assert cluster.wait_jobs_final([job_id], timeout_s=120) == {job_id: "succeeded"}
    cluster.stop()
    listed = json.loads(cluster.bonsai("workers", "--json").stdout)
    assert [w["state"] for w in listed["workers"]] == ["stopped"]  # a warm shutdown says so
    assert listed["queues_without_live_worker"] == ["io", "cpu", "gpu"]


def test_memory_hog_is_stopped_and_fails_the_job_after_the_attempt_limit(
    cluster: Cluster, demo_checkpoint: Path
) -> None:
    cluster.extra_env.update(BONSAI_STAGE_PACKAGE=FAULTS, BONSAI_TEST_DECOMPOSE_FAULT="hog",
                             BONSAI_WORKER_MEMORY_MB="900", BONSAI_MAX_ATTEMPTS="2")
    cluster.start_worker()
    cluster.start_reconciler(every_s=0.5)
    (job_id,) = cluster.submit(str(demo_checkpoint))
    assert cluster.wait_jobs_final([job_id], timeout_s=180) == {job_id: "failed"}
    attempts = cluster.runs(stage="decompose")
    assert [a.attempt for a in attempts] == [1, 2]  # no loop: the attempt limit holds
    for attempt in attempts:
        assert attempt.error_kind == "retryable"
        assert attempt.error_message.startswith("out of memory")
        assert "cap of 900 MB" in attempt.error_message and "BONSAI_WORKER_MEMORY_MB" in attempt.error_message
    (job,) = cluster.jobs()
    assert job.error_message.startswith("decompose failed: out of memory 2 times")
    assert "Traceback" not in job.error_message


def test_stage_process_killed_by_the_kernel_is_recorded_at_once(
    cluster: Cluster, demo_checkpoint: Path
) -> None:
    cluster.extra_env.update(BONSAI_STAGE_PACKAGE=FAULTS, BONSAI_TEST_DECOMPOSE_FAULT="sigkill",
                             BONSAI_MAX_ATTEMPTS="2", BONSAI_HEARTBEAT_TIMEOUT_S="600")
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint))
    # No reconciler and a 10-minute heartbeat timeout: only the worker's own record can settle it.
    assert cluster.wait_jobs_final([job_id], timeout_s=120) == {job_id: "failed"}
    attempts = cluster.runs(stage="decompose")
    assert [a.attempt for a in attempts] == [1, 2]
    assert all("killed (SIGKILL)" in a.error_message and "out-of-memory" in a.error_message for a in attempts)
    (job,) = cluster.jobs()
    assert job.error_message.startswith("decompose failed: worker lost 2 times")

"""`bonsai serve` in distributed mode: a submission is recorded and its first stage sent to Redis.

No worker runs here: the test checks what the API leaves behind (a queued attempt with a
task id, a message on the `io` queue, the queue depth in /metrics), then cancels the job.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis

from pipeline.app.api.auth import new_token
from tests.integration.conftest import free_port

pytestmark = pytest.mark.services

TOKEN, ENTRY = new_token("ci", ("submit",))
HEADERS = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
def base_url(pg_url: str, broker_url: str, tmp_path: Path) -> Iterator[str]:
    env = {
        **os.environ,
        "BONSAI_HOME": str(tmp_path / "home"),
        "BONSAI_DATABASE_URL": pg_url,
        "BONSAI_BROKER_URL": broker_url,
        "BONSAI_API_TOKENS": ENTRY,
        "BONSAI_SOURCE_ROOTS": str(tmp_path),
    }
    command = [sys.executable, "-m", "pipeline"]
    assert (
        subprocess.run([*command, "db", "upgrade"], env=env, capture_output=True, timeout=120).returncode == 0
    )
    port = free_port()
    log_path = tmp_path / "serve.log"
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*command, "serve", "--port", str(port)],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            assert process.poll() is None, log_path.read_text()
            try:
                if httpx.get(f"{base}/api/jobs", headers=HEADERS).status_code == 200:
                    break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log_path.read_text()
                time.sleep(0.2)
        yield base
    finally:
        process.terminate()
        process.wait(timeout=15)


def test_submission_is_recorded_and_sent_to_the_io_queue(base_url: str, broker_url: str) -> None:
    response = httpx.post(
        f"{base_url}/api/jobs",
        headers=HEADERS,
        json={"sources": ["org/model-a@main", "org/model-b"], "priority": 3},
    )
    assert response.status_code == 201, response.text
    job_ids = response.json()["job_ids"]
    assert len(job_ids) == 2

    def download_of(job_id: int) -> dict[str, Any]:
        detail = httpx.get(f"{base_url}/api/jobs/{job_id}", headers=HEADERS).json()
        assert detail["submitted_by"] == "api:ci" and detail["priority"] == 3
        [download] = detail["stages"]
        assert download["stage"] == "download"
        return download  # type: ignore[no-any-return]

    # No worker has beaten yet: the io queue gets one slot, so the broker holds one message and the
    # second job's download waits in the database for admission.
    assert download_of(job_ids[0])["status"] == "queued"
    assert download_of(job_ids[1])["status"] == "pending"
    waiting = httpx.get(f"{base_url}/api/jobs/{job_ids[1]}", headers=HEADERS).json()["waiting"]
    assert waiting == {"download": "queue io is full"}
    client = redis.Redis.from_url(broker_url)
    queued = sum(client.llen(key) for key in client.keys("io*") if client.type(key) == b"list")
    assert queued == 1, "one message on the io queue"
    metrics = httpx.get(f"{base_url}/metrics", headers=HEADERS).text
    assert 'bonsai_queue_depth{queue="io"} 1.0' in metrics
    assert 'bonsai_queue_depth{queue="cpu"} 0.0' in metrics

    cancelled = httpx.post(f"{base_url}/api/jobs/{job_ids[0]}/cancel", headers=HEADERS)
    assert cancelled.status_code == 200 and cancelled.json()["revoked"] == 1
    assert httpx.get(f"{base_url}/api/jobs/{job_ids[0]}", headers=HEADERS).json()["status"] == "cancelled"
    # The cancelled job's slot goes to the one waiting.
    assert download_of(job_ids[1])["status"] == "queued"

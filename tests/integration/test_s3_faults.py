"""Faults with a real S3 server: SeaweedFS killed mid-upload, and an object damaged in the bucket."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from pipeline.artifacts.s3 import S3Location, S3Store
from pipeline.core.settings import Settings
from pipeline.core.states import StageName, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.execution import execute_run
from pipeline.orchestration.progression import advance_job
from tests.support import seaweed

pytestmark = [pytest.mark.services, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
PART = 5 * 1024 * 1024


def _kill_when_parts_arrive(server: seaweed.SeaweedServer, bucket: str, done: threading.Event) -> None:
    """SIGKILL the server as soon as a multipart upload in `bucket` has received a part."""
    raw = seaweed.client(server.endpoint_url)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and not done.is_set():
        for upload in raw.list_multipart_uploads(Bucket=bucket).get("Uploads", []):
            parts = raw.list_parts(Bucket=bucket, Key=upload["Key"], UploadId=upload["UploadId"])
            if parts.get("Parts"):
                server.kill()
                return
        time.sleep(0.005)


def _next_download_run(rt, job_id: int) -> int:  # type: ignore[no-untyped-def]
    with session_scope(rt.sessions) as session:
        outcome = advance_job(session, job_id, max_attempts=rt.max_attempts, retry_base_s=0.0)
    assert [step.stage for step in outcome.ready] == [StageName.DOWNLOAD], outcome
    return outcome.ready[0].run_id


def test_server_killed_mid_upload(tmp_path: Path, demo_checkpoint: Path,
                                  monkeypatch: pytest.MonkeyPatch) -> None:
    server = seaweed.SeaweedServer(tmp_path / "seaweedfs").start()
    try:
        for name, value in seaweed.AWS_ENV.items():
            monkeypatch.setenv(name, value)
        bucket = seaweed.new_bucket(server.endpoint_url)
        source = tmp_path / "model"
        shutil.copytree(demo_checkpoint, source)
        big = os.urandom(96 * 1024 * 1024)  # 20 parts: the kill lands while they go up
        (source / "extra-weights.safetensors").write_bytes(big)
        big_key = S3Location(bucket, "store").key(hashlib.sha256(big).hexdigest())
        settings = Settings(home=tmp_path / "home", artifact_root=f"s3://{bucket}/store",
                            s3_endpoint_url=server.endpoint_url, s3_part_size_bytes=PART)
        rt = build_runtime(settings)
        assert isinstance(rt.store, S3Store)
        # Any unfinished upload of a key counts as a dead attempt's (the default waits an hour).
        store = S3Store(rt.store.location, rt.store._client, rt.store.cache, part_size_bytes=PART,
                        stale_upload_s=0)
        rt = dataclasses.replace(rt, store=store)
        with session_scope(rt.sessions) as session:
            job_id = repo.create_job(session, str(source), "tq2_0").id

        done = threading.Event()
        killer = threading.Thread(target=_kill_when_parts_arrive, args=(server, bucket, done))
        killer.start()
        first = _next_download_run(rt, job_id)
        try:
            state = execute_run(rt, first)
        finally:
            done.set()
            killer.join()
        assert server.process is not None and server.process.poll() is not None, "the server was killed"
        with session_scope(rt.sessions) as session:
            run = session.get_one(StageRun, first)
            assert (state, run.status, run.error_kind) == (StageState.FAILED, "failed", "retryable")
            assert "unreachable" in run.error_message and server.endpoint_url in run.error_message
            assert "Traceback" not in run.error_message

        server.start()
        raw = seaweed.client(server.endpoint_url)
        keys = [item["Key"] for item in raw.list_objects_v2(Bucket=bucket).get("Contents", [])]
        assert big_key not in keys, "no partial object is visible"
        orphans = raw.list_multipart_uploads(Bucket=bucket).get("Uploads", [])
        assert [u["Key"] for u in orphans] == [big_key], "the dead server could not be told to abort"

        second = _next_download_run(rt, job_id)
        assert execute_run(rt, second) is StageState.SUCCEEDED
        assert raw.list_multipart_uploads(Bucket=bucket).get("Uploads") is None, "the orphan was aborted"
        assert store.verify(hashlib.sha256(big).hexdigest())
        with session_scope(rt.sessions) as session:
            run = session.get_one(StageRun, second)
            assert run.attempt == 2
            assert run.metrics["store_uploaded_bytes"] >= len(big)
    finally:
        server.kill()


def _bonsai(env: dict[str, str], *args: str, timeout_s: float = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "pipeline", *args], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=timeout_s)


def test_object_damaged_in_the_bucket_is_refused_and_audit_names_it(
    tmp_path: Path, demo_checkpoint: Path, s3_bucket: str, s3_endpoint: str
) -> None:
    env = {**os.environ, "BONSAI_HOME": str(tmp_path / "home"), "BONSAI_ARTIFACT_ROOT": f"s3://{s3_bucket}/a",
           "BONSAI_CACHE_ROOT": str(tmp_path / "cache-1")}
    converted = _bonsai(env, "convert", str(demo_checkpoint))
    assert converted.returncode == 0, converted.stdout + converted.stderr
    detail = json.loads(_bonsai(env, "show", "1", "--json").stdout)
    inspect = next(s for s in detail["stages"] if s["stage"] == "inspect")
    card = next(o for o in inspect["outputs"] if o["name"] == "model_card.json")
    package = next(s for s in detail["stages"] if s["stage"] == "package")
    assert package["metrics"]["store_uploaded_bytes"] > 0
    assert package["metrics"]["store_cache_hits"] > 0, "the writer read its inputs from its own cache"

    key = card["uri"].removeprefix(f"s3://{s3_bucket}/")
    damaged = json.dumps({"architecture": "something else"}).encode()
    seaweed.client(s3_endpoint).put_object(Bucket=s3_bucket, Key=key, Body=damaged)

    # Another machine (an empty cache) reruns package: it must refuse the damaged card.
    elsewhere = {**env, "BONSAI_CACHE_ROOT": str(tmp_path / "cache-2")}
    rerun = _bonsai(elsewhere, "retry", "1", "--from", "package", "--force")
    assert rerun.returncode != 0
    detail = json.loads(_bonsai(elsewhere, "show", "1", "--json").stdout)
    attempt = [s for s in detail["stages"] if s["stage"] == "package"][-1]
    assert (attempt["attempt"], attempt["status"], attempt["error_kind"]) == (2, "failed", "permanent")
    damaged_sha = hashlib.sha256(damaged).hexdigest()
    assert card["uri"] in attempt["error_message"]
    assert f"{damaged_sha}, expected {card['sha256']}" in attempt["error_message"]

    audit = _bonsai(elsewhere, "audit", "--job", "1")
    assert audit.returncode == 1
    assert (f"tampered: inspect/model_card.json sha256 {card['sha256']} recorded, {damaged_sha}"
            in audit.stderr), audit.stderr

"""Distributed mode on the real things: `bonsai worker` processes, Redis, PostgreSQL, llama.cpp."""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
import redis

from tests.integration.conftest import free_port
from tests.support.cluster import Cluster, store_is_clean
from tests.support.hub_cache import COMMIT, REPO, cache_from_folder

pytestmark = [pytest.mark.services, pytest.mark.slow]

LATER_STAGES = ["checksum", "inspect", "calibrate", "decompose", "package", "validate"]


@pytest.fixture
def make_cluster(pg_url: str, tmp_path: Path) -> Iterator[object]:
    made: list[Cluster] = []

    def factory(broker: str, **extra_env: str) -> Cluster:
        cluster = Cluster(tmp_path / "home", pg_url, broker, dict(extra_env))
        cluster.home.mkdir(exist_ok=True)
        upgrade = cluster.bonsai("db", "upgrade")
        assert upgrade.returncode == 0, upgrade.stderr
        made.append(cluster)
        return cluster

    yield factory
    for cluster in made:
        cluster.stop()


def test_twenty_jobs_on_two_workers_store_each_output_once(make_cluster, broker_url, demo_checkpoint) -> None:
    cluster = make_cluster(broker_url)
    cluster.start_worker()
    cluster.start_worker()
    job_ids = cluster.submit(*[str(demo_checkpoint)] * 20)
    assert len(job_ids) == 20

    statuses = cluster.wait_jobs_final(job_ids, timeout_s=300)
    errors = [job.error_message for job in cluster.jobs() if job.error_message]
    assert set(statuses.values()) == {"succeeded"}, errors

    runs = cluster.runs()
    succeeded = Counter(run.stage for run in runs if run.status == "succeeded")
    for stage in LATER_STAGES:
        assert succeeded[stage] == 1, f"{stage} ran {succeeded[stage]} times; equal inputs must run once"
    cached = Counter(run.stage for run in runs if run.status == "skipped-cached")
    assert all(cached[stage] == 19 for stage in LATER_STAGES), cached
    assert len({run.worker_host for run in runs if run.worker_host}) >= 2, "both workers took work"
    assert store_is_clean(cluster.home / "artifacts") == []


# Decompose sleeps first (tests/support/fault_stages): the kill lands while it works, however fast
# the fit is on this machine.
HOLD_DECOMPOSE = {"BONSAI_STAGE_PACKAGE": "tests.support.fault_stages",
                  "BONSAI_TEST_DECOMPOSE_FAULT": "delay:4"}


def test_worker_killed_mid_decompose_is_retried(make_cluster, broker_url, demo_checkpoint) -> None:
    source = demo_checkpoint
    cluster = make_cluster(broker_url, **HOLD_DECOMPOSE)
    cluster.start_worker()
    cluster.start_worker()
    cluster.start_reconciler(every_s=0.5)
    (job_id,) = cluster.submit(str(source))

    cluster.wait_for(lambda: any(r.status == "running" for r in cluster.runs(stage="decompose")), 120,
                     "decompose to start")
    victim = cluster.runs(stage="decompose")[0]
    cluster.kill_worker_running(int(victim.worker_host.rsplit(":", 1)[1]))

    assert cluster.wait_jobs_final([job_id], timeout_s=240) == {job_id: "succeeded"}
    attempts = cluster.runs(stage="decompose")
    assert [a.attempt for a in attempts] == [1, 2]
    assert attempts[0].status == "failed" and attempts[0].error_kind == "retryable"
    assert attempts[0].error_message.startswith("worker lost")
    assert attempts[1].status == "succeeded"
    assert attempts[1].worker_host != attempts[0].worker_host
    assert store_is_clean(cluster.home / "artifacts") == []


def test_calibrate_and_decompose_of_one_job_run_at_once_on_two_workers(make_cluster, broker_url,
                                                                       demo_checkpoint) -> None:
    # tq2_0 reads no statistics: decompose does not wait for calibrate, and with two workers the
    # source's reference run starts beside it instead of after it.
    cluster = make_cluster(broker_url, **HOLD_DECOMPOSE)
    cluster.start_worker()
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint))
    assert cluster.wait_jobs_final([job_id], timeout_s=240) == {job_id: "succeeded"}
    runs = {run.stage: run for run in cluster.runs()}
    calibrate, decompose = runs["calibrate"], runs["decompose"]
    assert calibrate.status == decompose.status == "succeeded"
    assert calibrate.worker_host != decompose.worker_host
    assert calibrate.started_at < decompose.finished_at and decompose.started_at < calibrate.finished_at, (
        calibrate.started_at, calibrate.finished_at, decompose.started_at, decompose.finished_at)
    # The demo's lossy route (the cluster's default), so validate scored against calibrate's reference.
    assert runs["validate"].metrics["agreement"].get("measured") is not False


def test_an_exact_conversion_does_not_wait_for_a_calibrate_started_beside_it(make_cluster, broker_url,
                                                                              demo_checkpoint) -> None:
    # Calibrate is sent beside decompose; once decompose proves the file bit-exact, validate judges
    # it alone, whatever became of calibrate (kept for later jobs if it ran, not needed if it had not).
    cluster = make_cluster(broker_url, **HOLD_DECOMPOSE)
    cluster.start_worker()
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint), options=())  # exact by default
    assert cluster.wait_jobs_final([job_id], timeout_s=240) == {job_id: "succeeded"}
    runs = {run.stage: run for run in cluster.runs()}
    assert runs["decompose"].metrics["exact"] is True
    assert runs["calibrate"].status in ("succeeded", "running", "not-needed")
    assert runs["calibrate"].started_at is not None, "calibrate started beside decompose"
    validate = runs["validate"]
    assert validate.metrics["agreement"]["measured"] is False
    assert validate.metrics["agreement"]["reason"].startswith("not measured: weights bit-exact")


def test_an_early_calibrate_that_failed_is_not_needed_once_the_file_proves_exact(make_cluster, broker_url,
                                                                                demo_checkpoint) -> None:
    # Calibrate, sent beside decompose, fails retryably at once; decompose then proves the file exact.
    # The failure no longer matters: the attempt is recorded as not needed, its failure kept.
    cluster = make_cluster(broker_url, **HOLD_DECOMPOSE, BONSAI_TEST_CALIBRATE_FAULT="transient")
    cluster.start_worker()
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint), options=())  # exact by default
    assert cluster.wait_jobs_final([job_id], timeout_s=240) == {job_id: "succeeded"}
    (calibrate,) = cluster.runs(stage="calibrate")
    assert calibrate.status == "not-needed" and calibrate.started_at is not None, "it ran, then failed"
    assert calibrate.error_message is None and calibrate.error_kind is None
    failure = calibrate.metrics["failure"]
    assert failure["kind"] == "retryable" and "a test's fault" in failure["message"]
    assert "proved the conversion exact" in calibrate.metrics["not_needed"]
    assert "a test's fault" in (calibrate.log_text or ""), "the attempt's log keeps the failure"

    # A retry of the succeeded job says what each --from would rerun, and records nothing.
    before = len(cluster.runs())
    refused = cluster.bonsai("retry", str(job_id))
    said = refused.stdout + refused.stderr
    assert refused.returncode != 0 and "nothing to retry" in said, said
    assert "--from decompose reruns decompose, package, validate" in said
    assert len(cluster.runs()) == before
    assert {run.status for run in cluster.runs(job_id=job_id)} <= {"succeeded", "not-needed"}


def test_worker_lost_every_time_fails_with_reason(make_cluster, broker_url, demo_checkpoint) -> None:
    source = demo_checkpoint
    cluster = make_cluster(broker_url, BONSAI_MAX_ATTEMPTS="2", **HOLD_DECOMPOSE)
    cluster.start_worker()
    cluster.start_reconciler(every_s=0.5)
    (job_id,) = cluster.submit(str(source))
    for attempt in (1, 2):
        cluster.wait_for(
            lambda a=attempt: any(r.attempt == a and r.status == "running"
                                  for r in cluster.runs(stage="decompose")),
            120, f"decompose attempt {attempt}",
        )
        run = next(r for r in cluster.runs(stage="decompose") if r.attempt == attempt)
        cluster.kill_worker_running(int(run.worker_host.rsplit(":", 1)[1]))
        cluster.start_worker()

    assert cluster.wait_jobs_final([job_id], timeout_s=60) == {job_id: "failed"}
    (job,) = cluster.jobs()
    assert "worker lost 2 times" in job.error_message


def test_redis_restart_loses_no_job(make_cluster, demo_checkpoint, tmp_path: Path) -> None:
    port = free_port()
    redis_cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(tmp_path)]
    server = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)
    try:
        cluster = make_cluster(f"redis://127.0.0.1:{port}/0")
        cluster.wait_for(lambda: _redis_up(port), 10, "test redis")
        cluster.start_worker()
        cluster.start_reconciler(every_s=0.5)
        copies = []
        for index in range(4):
            copy = tmp_path / f"model{index}"
            shutil.copytree(demo_checkpoint, copy)
            copies.append(str(copy))
        job_ids = cluster.submit(*copies)
        cluster.wait_for(lambda: len(cluster.runs(status="succeeded")) >= 2, 120, "first stages")

        server.kill()  # no persistence: every queued message is gone
        server.wait()
        time.sleep(1.0)
        server = subprocess.Popen(redis_cmd, stdout=subprocess.DEVNULL)

        statuses = cluster.wait_jobs_final(job_ids, timeout_s=240)
        assert set(statuses.values()) == {"succeeded"}, statuses
    finally:
        server.kill()
        server.wait()


def test_postgres_connection_drops_are_survived(make_cluster, broker_url, demo_checkpoint, pg_url) -> None:
    cluster = make_cluster(broker_url)
    cluster.start_worker()
    cluster.start_reconciler(every_s=0.5)
    (job_id,) = cluster.submit(str(demo_checkpoint))
    cluster.wait_for(lambda: len(cluster.runs()) >= 3, 120, "the job to get going")
    database = pg_url.rsplit("/", 1)[1]
    admin = pg_url.replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0] + "/postgres"
    with psycopg.connect(admin, autocommit=True) as conn:
        dropped = conn.execute(
            "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE datname = %s AND pid <> "
            "pg_backend_pid()", (database,),
        ).fetchone()
    assert dropped and dropped[0] >= 1
    statuses = cluster.wait_jobs_final([job_id], timeout_s=240)
    assert statuses == {job_id: "succeeded"}, [(r.stage, r.attempt, r.error_message) for r in cluster.runs()]


def test_retry_from_package_reuses_upstream(make_cluster, broker_url, demo_checkpoint) -> None:
    cluster = make_cluster(broker_url)
    cluster.start_worker()
    (job_id,) = cluster.submit(str(demo_checkpoint))
    assert cluster.wait_jobs_final([job_id], timeout_s=180) == {job_id: "succeeded"}
    first_package = cluster.runs(stage="package")[0]

    result = cluster.bonsai("retry", str(job_id), "--from", "package", "--force")
    assert result.returncode == 0, result.stderr
    cluster.wait_for(lambda: len(cluster.runs(stage="validate")) == 2
                     and cluster.jobs()[0].status == "succeeded", 180, "the retry to finish")

    assert len(cluster.runs(stage="download")) == 1, "retry from package must not download again"
    assert len(cluster.runs(stage="decompose")) == 1
    packages = cluster.runs(stage="package")
    assert [(p.attempt, p.status) for p in packages] == [(1, "succeeded"), (2, "succeeded")]
    show = cluster.bonsai("show", str(job_id), "--json")
    import json

    detail = json.loads(show.stdout)
    runs = {(s["stage"], s["attempt"]): s for s in detail["stages"]}
    assert runs[("package", 1)]["inputs"] == runs[("package", 2)]["inputs"]
    assert runs[("package", 2)]["outputs"] == runs[("package", 1)]["outputs"], "packaging is deterministic"
    assert packages[0].id == first_package.id and packages[0].status == "succeeded"


def test_same_hub_checkpoint_submitted_twice_downloads_once(
    make_cluster, broker_url, demo_checkpoint, tmp_path: Path
) -> None:
    hub_cache = tmp_path / "hub"
    cache_from_folder(hub_cache, demo_checkpoint)
    cluster = make_cluster(broker_url, HF_HUB_OFFLINE="1", HF_HUB_CACHE=str(hub_cache))
    cluster.start_worker()
    cluster.start_worker()
    job_ids = cluster.submit(f"{REPO}@main", f"{REPO}@main")

    statuses = cluster.wait_jobs_final(job_ids, timeout_s=180)
    assert set(statuses.values()) == {"succeeded"}, statuses
    downloads = cluster.runs(stage="download")
    assert sorted(d.status for d in downloads) == ["skipped-cached", "succeeded"]
    assert all(job.resolved_revision == COMMIT for job in cluster.jobs())


def _redis_up(port: int) -> bool:
    try:
        return bool(redis.Redis(port=port, socket_connect_timeout=0.5).ping())
    except redis.RedisError:
        return False

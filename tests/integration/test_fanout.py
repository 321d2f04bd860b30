"""Decompose fanned out by shard across real workers gives the same GGUF as one process does."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.settings import Settings
from pipeline.core.states import JobState
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from tests.support.cluster import Cluster, store_is_clean
from tests.support.sharding import shard_checkpoint

pytestmark = [pytest.mark.services, pytest.mark.slow]


def _embedded_gguf(source: Path, home: Path) -> tuple[str, dict[str, object]]:
    rt = build_runtime(Settings(home=home))
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "tq2_0").id
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    with session_scope(rt.sessions) as session:
        runs = repo.latest_runs(session, job_id)
        gguf = next(link.artifact_sha256 for link in runs["package"].links if link.direction == "out")
        return gguf, dict(runs["decompose"].metrics)


def _cluster(pg_url: str, broker_url: str, home: Path, **env: str) -> Cluster:
    cluster = Cluster(home, pg_url, broker_url, dict(env))
    home.mkdir()
    assert cluster.bonsai("db", "upgrade").returncode == 0
    return cluster


def test_fanned_out_decompose_matches_one_process(
    pg_url, broker_url, demo_checkpoint, tmp_path: Path
) -> None:
    source = shard_checkpoint(demo_checkpoint, tmp_path / "sharded", n_shards=2)
    expected_gguf, expected = _embedded_gguf(source, tmp_path / "embedded")

    cluster = _cluster(pg_url, broker_url, tmp_path / "home")
    try:
        cluster.start_worker()
        cluster.start_worker()
        (job_id,) = cluster.submit(str(source), options=())  # the defaults, as the embedded job's
        assert cluster.wait_jobs_final([job_id], timeout_s=180) == {job_id: "succeeded"}
        decompose = cluster.runs(stage="decompose")
        parent = next(run for run in decompose if not run.shard)
        children = [run for run in decompose if run.shard]
        assert sorted(child.shard for child in children) == sorted(
            p.name for p in source.glob("model-*.safetensors"))
        assert all(child.parent_run_id == parent.id and child.status == "succeeded" for child in children)
        assert parent.status == "succeeded" and parent.metrics["fanout"] == 2
        for key in ("n_tensors", "n_ternary", "n_fallback", "sparsity", "bpw"):
            assert parent.metrics[key] == pytest.approx(expected[key]), key
        (package,) = cluster.runs(stage="package")
        with session_scope(cluster.sessions) as session:
            run = session.get_one(type(package), package.id)
            gguf = next(link.artifact_sha256 for link in run.links if link.direction == "out")
        assert gguf == expected_gguf, "fan-out must produce byte-identical GGUF"
        assert store_is_clean(cluster.home / "artifacts") == []
        audit = cluster.bonsai("audit", "--job", str(job_id))
        assert audit.returncode == 0, audit.stdout + audit.stderr
    finally:
        cluster.stop()


def test_lost_shard_child_is_retried_and_joined(pg_url, broker_url, demo_checkpoint, tmp_path: Path) -> None:
    source = shard_checkpoint(demo_checkpoint, tmp_path / "sharded", n_shards=2)
    # Each shard child sleeps first, so the kill lands while it works (tests/support/fault_stages).
    hold = {"BONSAI_STAGE_PACKAGE": "tests.support.fault_stages", "BONSAI_TEST_DECOMPOSE_FAULT": "delay:3"}
    cluster = _cluster(pg_url, broker_url, tmp_path / "home", **hold)
    try:
        cluster.start_worker()
        cluster.start_worker()
        cluster.start_reconciler(every_s=0.5)
        (job_id,) = cluster.submit(str(source))

        def child_running() -> bool:
            return any(r.shard and r.status == "running" for r in cluster.runs(stage="decompose"))

        cluster.wait_for(child_running, 120, "a shard child to start")
        victim = next(r for r in cluster.runs(stage="decompose") if r.shard and r.status == "running")
        cluster.kill_worker_running(int(victim.worker_host.rsplit(":", 1)[1]))
        cluster.start_worker()

        assert cluster.wait_jobs_final([job_id], timeout_s=240) == {job_id: "succeeded"}
        attempts = [r for r in cluster.runs(stage="decompose") if r.shard == victim.shard]
        # Exactly one retry of the lost child, and it did the work (not served from a duplicate's cache).
        assert [(a.attempt, a.status) for a in attempts] == [(1, "failed"), (2, "succeeded")]
        assert attempts[0].error_message.startswith("worker lost")
        assert attempts[1].retry_of_id == attempts[0].id
        parents = [r for r in cluster.runs(stage="decompose") if not r.shard]
        assert [p.status for p in parents] == ["succeeded"]
    finally:
        cluster.stop()

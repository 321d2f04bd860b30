"""Distributed mode with workers that share nothing but PostgreSQL, Redis and an S3 server."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.db.models import Artifact
from tests.support import seaweed
from tests.support.cluster import Cluster

pytestmark = [pytest.mark.services, pytest.mark.slow]


@pytest.fixture
def cluster(pg_url: str, broker_url: str, s3_bucket: str, s3_endpoint: str,
            tmp_path: Path) -> Iterator[Cluster]:
    env = {**seaweed.AWS_ENV, "BONSAI_ARTIFACT_ROOT": f"s3://{s3_bucket}/artifacts",
           "BONSAI_S3_ENDPOINT_URL": s3_endpoint}
    made = Cluster(tmp_path / "coordinator", pg_url, broker_url, env)
    made.home.mkdir()
    upgrade = made.bonsai("db", "upgrade")
    assert upgrade.returncode == 0, upgrade.stderr
    yield made
    made.stop()


def test_workers_with_their_own_homes_convert_through_the_bucket(cluster: Cluster, demo_checkpoint: Path,
                                                                 tmp_path: Path) -> None:
    # io and cpu stages on one machine, gpu stages (calibrate, decompose, validate) on another: the
    # second can only get the first one's outputs from the bucket.
    homes = [tmp_path / "machine-a", tmp_path / "machine-b"]
    cluster.start_worker("io,cpu", BONSAI_HOME=str(homes[0]))
    cluster.start_worker("gpu", BONSAI_HOME=str(homes[1]))
    job_ids = cluster.submit(str(demo_checkpoint), str(demo_checkpoint))
    statuses = cluster.wait_jobs_final(job_ids, timeout_s=300)
    assert set(statuses.values()) == {"succeeded"}, [j.error_message for j in cluster.jobs()]

    runs = [r for r in cluster.runs() if r.status == "succeeded"]
    # Decompose is a tq2_0 job's first gpu stage; calibrate runs after package (the demo's F16
    # embedding makes the conversion lossy, so validate needs the source's reference).
    decompose = next(r for r in runs if r.stage == "decompose")
    assert decompose.metrics["store_cache_misses"] > 0 and decompose.metrics["store_downloaded_bytes"] > 0
    calibrate = next(r for r in runs if r.stage == "calibrate")
    assert calibrate.metrics["store_cache_hits"] > 0, "calibrate read the source decompose fetched"
    package = next(r for r in runs if r.stage == "package")
    assert package.metrics["store_cache_misses"] > 0, "package fetched decompose's parts from the bucket"
    assert package.metrics["store_cache_hits"] > 0, "and read the card it wrote itself from its cache"
    for home in homes:
        assert not (home / "artifacts").exists(), f"{home} must hold no artifact store"
        assert any((home / "cache" / "sha256").rglob("*")), f"{home} caches what it read or wrote"

    bucket = cluster.extra_env["BONSAI_ARTIFACT_ROOT"].removeprefix("s3://").split("/")[0]
    listed = seaweed.client(cluster.extra_env["BONSAI_S3_ENDPOINT_URL"]).list_objects_v2(Bucket=bucket)
    stored = {item["Key"].rsplit("/", 1)[1] for item in listed["Contents"]}
    with cluster.sessions() as session:
        artifacts = session.scalars(select(Artifact)).all()
        recorded = {a.sha256 for a in artifacts}
        assert all(a.uri == f"s3://{bucket}/artifacts/sha256/{a.sha256[:2]}/{a.sha256}" for a in artifacts)
    assert recorded <= stored, "every recorded artifact is in the bucket"
    audit = cluster.bonsai("audit", "--job", str(job_ids[0]))
    assert audit.returncode == 0, audit.stderr

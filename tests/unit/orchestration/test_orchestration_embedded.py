"""Orchestration in embedded mode (SQLite, in-process): retries, cache reuse, retry and cancel."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select

from pipeline.core.errors import InputError, TransientError
from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import Artifact, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import cancel_job, read_manifest, retry_job
from pipeline.orchestration.runtime import Runtime
from pipeline.stages.base import StageClients


class FlakyHub:
    """A hub that is always unreachable, or that names a repo it does not have."""

    def __init__(self, error: Exception) -> None:
        self.error = error
        self.calls = 0

    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        self.calls += 1
        raise self.error

    def list_files_with_sha256(self, repo_id: str, commit_sha: str) -> list[object]:
        raise self.error

    def download_snapshot(self, repo_id: str, commit_sha: str, allow_patterns: Any = None) -> Path:
        raise self.error


def _runtime(tmp_path: Path, **clients: object) -> Runtime:
    rt = build_runtime(Settings(home=tmp_path / "home", retry_base_s=0.01, max_attempts=3))
    return Runtime(**{**rt.__dict__, "clients": StageClients(**clients) if clients else rt.clients})


def _submit(rt: Runtime, source: str) -> int:
    with session_scope(rt.sessions) as session:
        return repo.create_job(session, source, "tq2_0").id


def _runs(rt: Runtime, job_id: int) -> list[StageRun]:
    with session_scope(rt.sessions) as session:
        return list(session.scalars(select(StageRun).where(StageRun.job_id == job_id).order_by(StageRun.id)))


def test_retryable_error_is_retried_with_backoff_then_fails(tmp_path: Path) -> None:
    hub = FlakyHub(TransientError("hub answered 503 for acme/model"))
    rt = _runtime(tmp_path, hub=hub)
    job_id = _submit(rt, "acme/model@main")
    assert run_job(rt, job_id) is JobState.FAILED
    runs = _runs(rt, job_id)
    expected = [("download", n, "retryable") for n in (1, 2, 3)]
    assert [(r.stage, r.attempt, r.error_kind) for r in runs] == expected
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        assert job.error_message.startswith("download failed after 3 attempts")
        assert "503" in job.error_message


def test_permanent_error_fails_at_once(tmp_path: Path) -> None:
    hub = FlakyHub(InputError("repository acme/missing does not exist"))
    rt = _runtime(tmp_path, hub=hub)
    job_id = _submit(rt, "acme/missing@main")
    assert run_job(rt, job_id) is JobState.FAILED
    (run,) = _runs(rt, job_id)
    assert run.error_kind == "permanent" and "acme/missing" in run.error_message


def test_second_job_reuses_every_cached_stage(tmp_path: Path, demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path)
    first = _submit(rt, str(demo_checkpoint))
    assert run_job(rt, first) is JobState.SUCCEEDED
    second = _submit(rt, str(demo_checkpoint))
    assert run_job(rt, second) is JobState.SUCCEEDED

    first_runs = {r.stage: r for r in _runs(rt, first)}
    second_runs = {r.stage: r for r in _runs(rt, second)}
    assert second_runs["download"].status == "succeeded", "a local folder may change: always re-read"
    for stage in ("checksum", "inspect", "decompose", "package", "validate"):
        run = second_runs[stage]
        assert run.status == "skipped-cached", stage
        assert run.cached_from_id == first_runs[stage].id
        assert run.cache_key == first_runs[stage].cache_key
    with session_scope(rt.sessions) as session:
        ggufs = session.scalars(select(Artifact).where(Artifact.kind == "gguf")).all()
        assert len(ggufs) == 1


def test_retry_from_a_stage_keeps_earlier_attempts_and_force_reruns(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    rt = _runtime(tmp_path)
    job_id = _submit(rt, str(demo_checkpoint))
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    with session_scope(rt.sessions) as session:
        new = retry_job(session, job_id, StageName.PACKAGE, force=True)
    assert len(new) == 2
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    runs = _runs(rt, job_id)
    package = [r for r in runs if r.stage == "package"]
    assert [(r.attempt, r.status) for r in package] == [(1, "succeeded"), (2, "succeeded")]
    assert [r.stage for r in runs].count("download") == 1
    assert package[1].metrics["tensor_count"] == package[0].metrics["tensor_count"]


def test_retry_refuses_a_stage_whose_upstream_did_not_succeed(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    job_id = _submit(rt, str(tmp_path / "missing"))
    assert run_job(rt, job_id) is JobState.FAILED
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="retry from download"):
        retry_job(session, job_id, StageName.PACKAGE, force=False)
    # Sensitivity runs only for auto with sensitivity=measured: this job has none to retry.
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="has no sensitivity stage"):
        retry_job(session, job_id, StageName.SENSITIVITY, force=False)


def test_cancel_marks_unfinished_attempts(tmp_path: Path) -> None:
    rt = _runtime(tmp_path)
    job_id = _submit(rt, "anything")
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        run = repo.new_attempt(session, job, StageName.DOWNLOAD)
        run.task_id = "task-1"
    with session_scope(rt.sessions) as session:
        assert cancel_job(session, job_id) == ["task-1"]
    assert run_job(rt, job_id) is JobState.CANCELLED
    assert [r.status for r in _runs(rt, job_id)] == ["cancelled"]
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="already cancelled"):
        cancel_job(session, job_id)


def test_manifest_forms_and_errors(tmp_path: Path) -> None:
    good = tmp_path / "jobs.yaml"
    good.write_text("jobs:\n  - ./a\n  - {source: org/b@main, recipe: tq1_0, priority: 3}\n")
    requests = read_manifest(good, "tq2_0", 0)
    parsed = [(r.source, r.recipe, r.priority) for r in requests]
    assert parsed == [("./a", "tq2_0", 0), ("org/b@main", "tq1_0", 3)]
    as_json = tmp_path / "jobs.json"
    as_json.write_text(json.dumps([{"source": "x", "colour": "red"}]))
    with pytest.raises(InputError, match=r"entry 1: unknown keys \['colour'\]"):
        read_manifest(as_json, "tq2_0", 0)
    empty = tmp_path / "empty.yaml"
    empty.write_text("[]")
    with pytest.raises(InputError, match="non-empty list"):
        read_manifest(empty, "tq2_0", 0)


def test_statements_are_signed_as_they_are_recorded_when_a_key_is_set(
    tmp_path: Path, demo_checkpoint: Path
) -> None:
    pytest.importorskip("cryptography", reason="pip install '.[signing]' for signing")
    from pipeline.db.models import Provenance
    from pipeline.provenance import signing

    private_path, _public_path = signing.generate_key(tmp_path / "key.pem")
    key = signing.load_private_key(private_path)
    rt = Runtime(**{**_runtime(tmp_path).__dict__, "signing_key": key})
    job_id = _submit(rt, str(demo_checkpoint))
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    with session_scope(rt.sessions) as session:
        rows = session.scalars(select(Provenance)).all()
        assert rows
        for row in rows:
            (stored,) = signing.envelopes_for(session, rt.store, row)
            assert signing.verify_envelope(stored.envelope, key.public_key()) == row.statement


def test_secret_looking_options_are_refused_before_anything_is_recorded(tmp_path: Path) -> None:
    from pipeline.db.models import Job
    from pipeline.orchestration.job_control import JobRequest, create_jobs
    from pipeline.stages.sources import SourcePolicy

    rt = _runtime(tmp_path)
    requests = [JobRequest("./ok"), JobRequest("./bad", options={"hf_token": "hf_abc"})]
    with session_scope(rt.sessions) as session:
        with pytest.raises(InputError, match="./bad: options must not carry"):
            create_jobs(session, requests, "test", SourcePolicy(allow_any_local=True))
    with session_scope(rt.sessions) as session:
        assert session.scalars(select(Job)).all() == []


def test_a_job_validates_against_a_block_wise_torch_reference(tmp_path: Path, demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path)
    options = {"reference_engine": "torch", "importance": "imatrix", "calibration_ctx": 64}
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(demo_checkpoint), "tq2_0", options).id
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    with session_scope(rt.sessions) as session:
        latest = repo.latest_runs(session, job_id)
        calibrate, validate = latest[StageName.CALIBRATE], latest[StageName.VALIDATE]
        assert calibrate.status == "succeeded" and calibrate.metrics["reference_engine"] == "torch"
        checks, agreement = validate.metrics["checks"], validate.metrics["agreement"]
    assert "source_answer" not in checks, "a reference-only run has no answers to judge"
    # The file is exact (ternary weights), so what is left is llama.cpp's rounding against torch's float32.
    assert checks["agreement"] == "pass" and agreement["mean_kl"] < 1e-3, agreement


def test_retry_of_a_succeeded_job_says_what_it_would_rerun_and_waits_only_for_a_stage_it_reruns(
    tmp_path: Path,
) -> None:
    rt = _runtime(tmp_path)
    job_id = _submit(rt, "anything")
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        for stage in StageName:
            if stage is StageName.SENSITIVITY:
                continue
            run = repo.new_attempt(session, job, stage)
            repo.set_stage_state(session, run, StageState.RUNNING)
            if stage is not StageName.CALIBRATE:  # started beside decompose, still running
                repo.set_stage_state(session, run, StageState.SUCCEEDED)
        repo.set_job_state(session, job, JobState.RUNNING)
        repo.set_job_state(session, job, JobState.SUCCEEDED)
    with session_scope(rt.sessions) as session:
        with pytest.raises(InputError, match="still runs in the background"):
            retry_job(session, job_id, StageName.CALIBRATE, force=False)
    with session_scope(rt.sessions) as session:
        assert len(retry_job(session, job_id, StageName.PACKAGE, force=False)) == 2  # package, validate
    with session_scope(rt.sessions) as session:
        job = repo.get_job(session, job_id)
        for run in repo.latest_runs(session, job_id).values():
            if run.status is StageState.PENDING:
                repo.set_stage_state(session, run, StageState.RUNNING)
            if run.status is StageState.RUNNING:
                repo.set_stage_state(session, run, StageState.SUCCEEDED)
        repo.set_job_state(session, job, JobState.SUCCEEDED)
    with session_scope(rt.sessions) as session, pytest.raises(InputError) as refused:
        retry_job(session, job_id, None, force=False)
    assert "nothing to retry" in str(refused.value)
    assert "--from package reruns package, validate" in str(refused.value)


def test_statements_name_the_configured_worker_as_their_builder(tmp_path: Path) -> None:
    from pipeline.db.models import Provenance

    source = tmp_path / "no-weights"  # download and checksum store outputs; inspect fails
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    rt = build_runtime(Settings(home=tmp_path / "home", worker_name="gpu-pool-1", max_attempts=1))
    assert build_runtime(Settings(home=tmp_path / "other")).worker_name  # the host's name by default
    job_id = _submit(rt, str(source))
    assert run_job(rt, job_id) is JobState.FAILED
    with session_scope(rt.sessions) as session:
        statements = [row.statement for row in session.scalars(select(Provenance))]
    assert statements
    for statement in statements:
        details = statement["predicate"]["runDetails"]
        assert details["builder"]["id"] == "urn:bonsai-pipeline:worker:gpu-pool-1"
        assert {"name": "process", "content": rt.worker_host} in details["byproducts"]

"""`bonsai gc` on a real embedded home (SQLite, local store): what it takes, what it keeps, what follows."""

from __future__ import annotations

import json
import sqlite3
from datetime import timedelta
from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import select, update

from pipeline.app.cli import cli
from pipeline.core.errors import InputError
from pipeline.core.settings import Settings
from pipeline.core.states import JobState, LinkDirection, StageName
from pipeline.db import repo, retention
from pipeline.db.models import Artifact, Job, RunArtifact, StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import retry_job
from pipeline.orchestration.runtime import Runtime
from pipeline.orchestration.store_gc import GcRules, collect_garbage, parse_age, source_digests
from pipeline.provenance.audit import audit_artifact, job_gguf


def _runtime(home: Path) -> Runtime:
    return build_runtime(Settings(home=home, retry_base_s=0.01))


def _job(rt: Runtime, source: Path, **options: object) -> int:
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(source), "tq2_0", options).id
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    return job_id


def _digests(rt: Runtime, job_id: int) -> set[str]:
    with session_scope(rt.sessions) as session:
        return set(session.scalars(
            select(RunArtifact.artifact_sha256).join(StageRun).where(StageRun.job_id == job_id)))


def _gc(rt: Runtime, **rules: object):  # type: ignore[no-untyped-def]
    with session_scope(rt.sessions) as session:
        return collect_garbage(session, rt.store, GcRules(**rules))  # type: ignore[arg-type]


def _set_job_state(rt: Runtime, job_id: int, state: JobState) -> None:
    with session_scope(rt.sessions) as session:
        session.execute(update(Job).where(Job.id == job_id).values(status=state))


def test_gc_takes_a_finished_jobs_bytes_and_audit_says_not_retained(tmp_path: Path,
                                                                   demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    job_id = _job(rt, demo_checkpoint)
    digests = _digests(rt, job_id)
    assert all(rt.store.has(sha) for sha in digests)

    dry = _gc(rt, dry_run=True)
    assert {sha for sha, _size in dry.removed} == digests
    assert all(rt.store.has(sha) for sha in digests), "a dry run removes nothing"

    report = _gc(rt)
    assert {sha for sha, _size in report.removed} == digests
    assert not any(rt.store.has(sha) for sha in digests)
    assert _gc(rt).removed == [], "released bytes are not taken twice"
    with session_scope(rt.sessions) as session:
        gguf = job_gguf(session, job_id).sha256
        audit = audit_artifact(session, rt.store, gguf)
    assert audit.is_ok, audit.problems
    assert audit.not_retained == len(audit.nodes)
    assert all(node["note"].startswith("bytes not retained") for node in audit.nodes)


def test_unfinished_and_failed_jobs_pins_and_recent_use_keep_bytes(tmp_path: Path,
                                                                   demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    job_id = _job(rt, demo_checkpoint)
    digests = _digests(rt, job_id)
    for state in (JobState.RUNNING, JobState.FAILED, JobState.PENDING):
        _set_job_state(rt, job_id, state)
        report = _gc(rt)
        assert report.removed == [], state
        assert report.kept["unfinished job"] == len(digests)
    _set_job_state(rt, job_id, JobState.SUCCEEDED)

    assert _gc(rt, older_than=timedelta(hours=1)).removed == [], "everything was used within the hour"
    with session_scope(rt.sessions) as session:
        gguf = job_gguf(session, job_id)
        assert retention.pin(session, gguf, retention.PIN, "test")
        assert not retention.pin(session, gguf, retention.PIN, "test")
    report = _gc(rt)
    assert gguf.sha256 not in {sha for sha, _size in report.removed}
    assert rt.store.has(gguf.sha256) and report.kept["pinned"] == 1
    with session_scope(rt.sessions) as session:
        assert retention.unpin(session, session.get_one(Artifact, gguf.sha256)) == 1
    assert {sha for sha, _size in _gc(rt).removed} == {gguf.sha256}


def test_published_gguf_is_kept_only_when_asked(tmp_path: Path, demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    job_id = _job(rt, demo_checkpoint)
    from pipeline.app.publishing import publish_job

    with session_scope(rt.sessions) as session:
        publish_job(session, rt.store, job_id, str(tmp_path / "bundle"))
        gguf = job_gguf(session, job_id).sha256
    kept = _gc(rt, keep_published=True)
    assert gguf not in {sha for sha, _size in kept.removed} and kept.kept["published"] == 1
    assert gguf in {sha for sha, _size in _gc(rt).removed}
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="retry 1 --from package"):
        publish_job(session, rt.store, job_id, str(tmp_path / "again"))


def test_retry_after_gc_names_the_stage_to_rerun_and_rerunning_restores(tmp_path: Path,
                                                                      demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    job_id = _job(rt, demo_checkpoint)
    _gc(rt)
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="retry from download"):
        retry_job(session, job_id, StageName.VALIDATE, force=False)
    with session_scope(rt.sessions) as session:
        retry_job(session, job_id, StageName.DOWNLOAD, force=False)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    with session_scope(rt.sessions) as session:
        gguf = job_gguf(session, job_id)
        assert gguf.released_at is None and rt.store.has(gguf.sha256)
        report = audit_artifact(session, rt.store, gguf.sha256)
        latest = repo.latest_runs(session, job_id).values()
        remade = {link.artifact_sha256 for run in latest for link in run.links}
    # The retried attempts' bytes are all back; what only the first attempts made (the older statement's
    # inputs, such as a report with its timings) stays released, and the audit says so without failing.
    assert report.is_ok
    assert remade and all(node.get("retained", True) for node in report.nodes if node["sha256"] in remade)


def test_a_later_job_remakes_bytes_gc_took_from_a_cached_result(tmp_path: Path,
                                                                demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    first = _job(rt, demo_checkpoint)
    _gc(rt)
    second = _job(rt, demo_checkpoint)
    with session_scope(rt.sessions) as session:
        statuses = {run.stage: run.status for run in repo.latest_runs(session, second).values()}
        report = audit_artifact(session, rt.store, job_gguf(session, second).sha256)
    assert "skipped-cached" not in statuses.values(), "a result whose bytes are gone is recomputed"
    assert report.is_ok
    assert all(node.get("retained", True) for node in report.nodes if node["sha256"] in _digests(rt, second))
    assert _digests(rt, first) & _digests(rt, second), "the same bytes, stored again"


def test_keep_source_false_drops_only_the_source_copy(tmp_path: Path, demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path / "home")
    job_id = _job(rt, demo_checkpoint, keep_source=False)
    with session_scope(rt.sessions) as session:
        sources = source_digests(session, job_id)
        gguf = job_gguf(session, job_id).sha256
    assert sources and not any(rt.store.has(sha) for sha in sources)
    assert rt.store.has(gguf)
    kept = _job(rt, demo_checkpoint)
    with session_scope(rt.sessions) as session:
        assert all(rt.store.has(sha) for sha in source_digests(session, kept))


def test_gc_holds_sqlites_write_lock_until_it_commits(tmp_path: Path) -> None:
    rt = _runtime(tmp_path / "home")
    with session_scope(rt.sessions) as session:
        collect_garbage(session, rt.store, GcRules())
        other = sqlite3.connect(tmp_path / "home" / "bonsai.db", timeout=0.1)
        with pytest.raises(sqlite3.OperationalError, match="locked"):
            other.execute("INSERT INTO workers (name, hostname, pid, queues, concurrency, held_task_ids, "
                          "started_at, heartbeat_at) VALUES ('w', 'h', 1, '[]', 1, '[]', '2026-01-01', "
                          "'2026-01-01')")
        other.close()


@pytest.mark.parametrize("text, seconds", [("90s", 90), ("45m", 2700), ("12h", 43200), ("7d", 604800),
                                           ("2w", 1209600), (" 3 d ", 259200)])
def test_parse_age(text: str, seconds: int) -> None:
    assert parse_age(text).total_seconds() == seconds


@pytest.mark.parametrize("text", ["", "7", "7 days", "-1d", "1y", "1e3s"])
def test_parse_age_refuses_with_the_forms_it_takes(text: str) -> None:
    with pytest.raises(InputError, match="90s, 45m, 12h, 7d or 2w"):
        parse_age(text)


def test_cli_gc_pin_and_unpin(tmp_path: Path, demo_checkpoint: Path) -> None:
    home = tmp_path / "home"
    rt = _runtime(home)
    job_id = _job(rt, demo_checkpoint)
    with session_scope(rt.sessions) as session:
        gguf = job_gguf(session, job_id).sha256
    runner = CliRunner()
    pinned = runner.invoke(cli, ["--home", str(home), "pin", gguf[:10]])
    assert pinned.exit_code == 0 and f"pinned {gguf}" in pinned.output
    dry = runner.invoke(cli, ["--home", str(home), "gc", "--dry-run", "--json"])
    assert dry.exit_code == 0, dry.output
    planned = json.loads(dry.output)
    assert planned["dry_run"] and gguf not in planned["removed_sha256"] and planned["removed"] > 0
    bad = runner.invoke(cli, ["--home", str(home), "gc", "--older-than", "a week"])
    assert bad.exit_code == 2 and "write it like 90s" in bad.output and "Traceback" not in bad.output
    done = runner.invoke(cli, ["--home", str(home), "gc"])
    assert done.exit_code == 0 and done.output.startswith(f"removed {planned['removed']} artifact(s)")
    assert "1 pinned" in done.output
    assert runner.invoke(cli, ["--home", str(home), "unpin", gguf]).output.startswith("unpinned")
    runner.invoke(cli, ["--home", str(home), "gc"])
    again = runner.invoke(cli, ["--home", str(home), "pin", gguf])
    assert again.exit_code == 2 and "removed its bytes already" in again.output
    audit = runner.invoke(cli, ["--home", str(home), "audit", gguf])
    assert audit.exit_code == 0 and "bytes not retained" in audit.output
    with session_scope(rt.sessions) as session:
        links = session.scalars(select(RunArtifact).where(RunArtifact.direction == LinkDirection.OUT)).all()
        assert links, "rows and links stay"

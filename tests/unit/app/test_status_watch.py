"""`bonsai status --watch` into a pipe, retry's cache report and attempt logs, in embedded mode."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from pathlib import Path

from sqlalchemy import select

from pipeline.app.attempt_logs import attempt_logs, print_logs
from pipeline.app.retrying import outcome_lines, planned_lines
from pipeline.app.watch import JobLine, Snapshot, take_snapshot, watch_status
from pipeline.core.errors import TransientError
from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageName
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.attempt_log import MAX_LINES, AttemptLog
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import retry_job
from pipeline.orchestration.runtime import Runtime
from pipeline.stages.base import StageClients


def _line(job_id: int, status: str, stage: str | None, attempt: int | None, retries: int = 0,
          queue: str | None = None) -> JobLine:
    return JobLine(job_id, status, 0.5, stage, attempt, retries, 0, "acme/m", queue)


def test_plain_watch_prints_changes_only_and_exits_when_all_done(monkeypatch) -> None:
    monkeypatch.setattr("time.sleep", lambda _s: None)
    inspecting = _line(2, "running", "inspect", 1, queue="cpu")
    frames = iter([
        Snapshot((_line(1, "running", "download", 1), inspecting), ("cpu",)),
        Snapshot((_line(1, "running", "download", 2, retries=1), inspecting), ("cpu",)),
        Snapshot((_line(1, "failed", "download", 3, retries=2), _line(2, "succeeded", None, None)), ()),
    ])
    asked: list[Sequence[int] | None] = []

    def look(ids: Sequence[int] | None) -> Snapshot:
        asked.append(ids)
        return next(frames)

    printed: list[str] = []
    code = watch_status(look, 0.5, is_tty=False, echo=printed.append)
    assert code == 1  # job 1 failed
    assert asked == [None, [1, 2], [1, 2]]  # the first look fixes which jobs are watched
    assert printed == [
        "job 1 running download (attempt 1) 50%  acme/m",
        "job 2 running inspect (attempt 1) 50%  acme/m",
        "job 1 running download (attempt 2) 50%, 1 retried  acme/m",
        "job 1 failed download (attempt 3) 50%, 2 retried  acme/m",
        "job 2 succeeded 50%  acme/m",
    ]


def test_no_live_worker_is_warned_about_once(monkeypatch, capsys) -> None:
    monkeypatch.setattr("time.sleep", lambda _s: None)
    waiting = Snapshot((_line(3, "running", "decompose", 1, queue="gpu"),), ("gpu",))
    frames = iter([waiting, waiting, Snapshot((_line(3, "succeeded", None, None),), ())])
    assert watch_status(lambda _ids: next(frames), 1.0, is_tty=False, echo=lambda _t: None) == 0
    err = capsys.readouterr().err
    assert err.count("no live worker") == 1
    assert "job 3 waits on queue 'gpu'" in err and "bonsai worker --queues gpu" in err


class DownHub:
    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        logging.getLogger("pipeline.clients.hub").info("asking the hub for %s", repo_id)
        raise TransientError("the hub answered HTTP 503; retry later")

    def list_files_with_sha256(self, repo_id: str, commit_sha: str) -> list[object]:
        raise AssertionError("not reached")

    def download_snapshot(self, repo_id: str, commit_sha: str, allow_patterns: object = None) -> Path:
        raise AssertionError("not reached")


def _runtime(tmp_path: Path, **clients: object) -> Runtime:
    rt = build_runtime(Settings(home=tmp_path / "home", retry_base_s=0.01, max_attempts=2))
    return Runtime(**{**rt.__dict__, "clients": StageClients(**clients) if clients else rt.clients})


def test_snapshot_counts_retries_of_a_real_job(tmp_path: Path) -> None:
    rt = _runtime(tmp_path, hub=DownHub())
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, "acme/model@main", "tq2_0").id
    assert run_job(rt, job_id) is JobState.FAILED
    (line,) = take_snapshot(rt, [job_id], None, None).lines
    assert (line.status, line.stage, line.attempt, line.retries) == ("failed", "download", 2, 1)


def test_retry_names_the_attempts_served_from_the_cache(tmp_path: Path, demo_checkpoint: Path) -> None:
    rt = _runtime(tmp_path)
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, str(demo_checkpoint), "tq2_0", {"agreement_text": ""}).id
    run_job(rt, job_id)
    with session_scope(rt.sessions) as session:
        run_ids = retry_job(session, job_id, StageName.PACKAGE, force=False)
    run_job(rt, job_id)
    lines = outcome_lines(rt, job_id, run_ids, "package")
    assert lines[0].startswith(f"job {job_id}: served from the cache, nothing recomputed: package (result")
    assert "validate (result of run" in lines[0]
    assert lines[1] == f"  to compute them again: bonsai retry {job_id} --from package --force"
    assert "--force" in planned_lines(job_id, ["package", "validate"], force=False)[1]

    with session_scope(rt.sessions) as session:
        forced = retry_job(session, job_id, StageName.VALIDATE, force=True)
    run_job(rt, job_id)
    assert outcome_lines(rt, job_id, forced, "validate") == []

    entries = attempt_logs(rt, job_id, StageName.DECOMPOSE, None)
    assert entries and any("stage decompose" in line for line in entries[0]["lines"])
    printed: list[str] = []
    print_logs(attempt_logs(rt, job_id, StageName.PACKAGE, 2), echo=printed.append)
    assert printed[0].startswith("== package attempt 2") and "served from the cache" in printed[1]


def test_failed_attempt_keeps_its_log_lines(tmp_path: Path) -> None:
    rt = _runtime(tmp_path, hub=DownHub())
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, "acme/model@main", "tq2_0").id
    run_job(rt, job_id)
    with session_scope(rt.sessions) as session:
        runs = list(session.scalars(select(StageRun).where(StageRun.job_id == job_id)))
        assert all(run.log_text for run in runs)
    printed: list[str] = []
    print_logs(attempt_logs(rt, job_id, StageName.DOWNLOAD, 1), echo=printed.append)
    assert any("asking the hub for acme/model" in line for line in printed)
    assert printed[-1] == "   error: TransientError: the hub answered HTTP 503; retry later"


def test_attempt_log_keeps_the_tail_of_this_thread_only() -> None:
    import threading

    logger = logging.getLogger("pipeline.stages.test")
    with AttemptLog() as captured:
        for index in range(MAX_LINES + 5):
            logger.info("line %d", index)
        other = threading.Thread(target=lambda: logger.warning("from another thread"))
        other.start()
        other.join()
    lines = captured.text().splitlines()
    assert lines[0] == "… 5 earlier line(s) not kept"
    assert lines[-1].endswith(f"line {MAX_LINES + 4}") and len(lines) == MAX_LINES + 1
    assert not any("another thread" in line for line in lines)


class RefusingHub(DownHub):
    def resolve_revision(self, repo_id: str, revision: str | None) -> str:
        from pipeline.stages.validate import ValidationFailed

        raise ValidationFailed("validation failed: repetition (the whole report: `bonsai show JOB --json`, "
                               "under validation)", {"verdict": "fail"})


def test_a_failure_pointing_at_show_names_the_real_job(tmp_path: Path) -> None:
    rt = _runtime(tmp_path, hub=RefusingHub())
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, "acme/model@main", "tq2_0").id
    assert run_job(rt, job_id) is JobState.FAILED
    with session_scope(rt.sessions) as session:
        (run,) = session.scalars(select(StageRun).where(StageRun.job_id == job_id))
        assert f"`bonsai show {job_id} --json`" in run.error_message and "JOB" not in run.error_message
        assert run.metrics == {"verdict": "fail"}  # the evidence that command shows

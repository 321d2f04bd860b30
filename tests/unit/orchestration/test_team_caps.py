"""A team's caps refuse a submission whole, before anything is recorded: max_pending and the storage
quota (OverCap, which the API answers with 429), and the priority ceiling without the admin scope."""

from __future__ import annotations

from pathlib import Path

import pytest
from click.testing import CliRunner
from sqlalchemy import func, select

from pipeline.app.cli import cli
from pipeline.core.errors import InputError, OverCap
from pipeline.core.settings import Settings
from pipeline.core.teams import parse_teams
from pipeline.db import team_usage
from pipeline.db.models import Action, Job
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.orchestration.runtime import Runtime
from pipeline.stages.sources import SourcePolicy

_POLICY = SourcePolicy.from_roots((), allow_any_local=True)


def _source(tmp_path: Path) -> str:
    source = tmp_path / "no-weights"  # download and checksum store its one file, then inspect fails
    source.mkdir(exist_ok=True)
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    return str(source)


def _counts(rt: Runtime) -> tuple[int, int]:
    with session_scope(rt.sessions) as session:
        jobs = session.scalar(select(func.count(Job.id))) or 0
        return jobs, session.scalar(select(func.count(Action.id))) or 0


def test_max_pending_refuses_the_whole_submission_and_records_nothing(tmp_path: Path) -> None:
    rt = build_runtime(Settings(home=tmp_path / "home"))
    teams = parse_teams("[team.ml]\nmax_pending = 3")
    with session_scope(rt.sessions) as session:
        create_jobs(session, [JobRequest(_source(tmp_path))] * 2, "api:ana", _POLICY, team="ml", teams=teams)
    before = _counts(rt)
    with session_scope(rt.sessions) as session, pytest.raises(OverCap) as refused:
        create_jobs(session, [JobRequest(_source(tmp_path))] * 2, "api:bo", _POLICY, team="ml", teams=teams)
    assert "team ml is at its cap max_pending 3: it has 2 unfinished job(s)" in str(refused.value)
    assert refused.value.retry_after_s > 0
    assert _counts(rt) == before
    with session_scope(rt.sessions) as session:  # one more fits; another team is not counted
        assert len(create_jobs(session, [JobRequest(_source(tmp_path))], "api:bo", _POLICY, team="ml",
                               teams=teams)) == 1
        assert team_usage.unfinished_jobs(session, "ml") == 3
        assert create_jobs(session, [JobRequest(_source(tmp_path))], "api:cy", _POLICY, teams=teams)
        assert session.scalar(select(Job.team).where(Job.submitted_by == "api:cy")) == "api:cy"


def test_the_priority_ceiling_needs_the_admin_scope(tmp_path: Path) -> None:
    rt = build_runtime(Settings(home=tmp_path / "home"))
    teams = parse_teams("[default]\nmax_priority = 10")
    urgent = [JobRequest(_source(tmp_path), priority=11)]
    with session_scope(rt.sessions) as session, pytest.raises(InputError, match="above team api:ana's"):
        create_jobs(session, urgent, "api:ana", _POLICY, teams=teams)
    with session_scope(rt.sessions) as session:
        assert create_jobs(session, urgent, "api:ana", _POLICY, teams=teams, may_exceed_priority=True)


def test_the_storage_quota_counts_bytes_the_teams_jobs_first_stored(tmp_path: Path) -> None:
    rt = build_runtime(Settings(home=tmp_path / "home"))
    with session_scope(rt.sessions) as session:
        (job_id,) = create_jobs(session, [JobRequest(_source(tmp_path))], "cli:ana", _POLICY, team="ml")
    run_job(rt, job_id)
    with session_scope(rt.sessions) as session:
        stored = team_usage.stored_bytes(session, "ml")
        assert stored > 0 and team_usage.stored_bytes(session, "other") == 0
        usage = team_usage.usage_by_team(session, 3600.0)["ml"]
        assert usage.stored_bytes == stored and usage.usage_s > 0 and usage.unfinished_jobs == 0
    teams = parse_teams(f"[team.ml]\nstorage_quota_gb = {stored / 1024**3}")
    with session_scope(rt.sessions) as session, pytest.raises(OverCap, match="bonsai gc") as refused:
        create_jobs(session, [JobRequest(_source(tmp_path))], "cli:ana", _POLICY, team="ml", teams=teams)
    assert "team ml is at its storage quota" in str(refused.value)


def test_the_cli_refuses_over_a_cap_in_one_line(tmp_path: Path) -> None:
    teams_file = tmp_path / "teams.toml"
    teams_file.write_text("[team.ml]\nmax_pending = 0\n")
    result = CliRunner().invoke(cli, ["--home", str(tmp_path / "home"), "convert", _source(tmp_path)],
                                env={"BONSAI_TEAMS_FILE": str(teams_file), "BONSAI_TEAM": "ml"})
    assert result.exit_code == 2
    assert result.output.startswith("error: team ml is at its cap max_pending 0")
    assert "Traceback" not in result.output


def test_bonsai_teams_shows_each_teams_holdings_and_caps(tmp_path: Path) -> None:
    import json

    teams_file = tmp_path / "teams.toml"
    teams_file.write_text("[team.ml]\nweight = 3\nmax_running = 2\nstorage_quota_gb = 1\n")
    home = tmp_path / "home"
    rt = build_runtime(Settings(home=home, teams_file=teams_file))
    with session_scope(rt.sessions) as session:
        (done,) = create_jobs(session, [JobRequest(_source(tmp_path))], "cli:ana", _POLICY, team="ml",
                              teams=rt.teams)
    run_job(rt, done)
    with session_scope(rt.sessions) as session:
        create_jobs(session, [JobRequest(_source(tmp_path))], "cli:bo", _POLICY, teams=rt.teams)
    env = {"BONSAI_TEAMS_FILE": str(teams_file)}
    rows = {row["team"]: row for row in json.loads(
        CliRunner().invoke(cli, ["--home", str(home), "teams", "--json"], env=env).output)}
    assert rows["ml"]["weight"] == 3.0 and rows["ml"]["max_running"] == 2 and rows["ml"]["pending_jobs"] == 0
    assert rows["ml"]["stored_bytes"] > 0 and 0 < rows["ml"]["quota_used"] < 1 and rows["ml"]["usage_s"] >= 0
    assert rows["cli:bo"]["pending_jobs"] == 1 and rows["cli:bo"]["quota_used"] is None
    assert rows["ml"]["weighted_share"] == 0.75  # 3 of 3 + 1
    shown = CliRunner().invoke(cli, ["--home", str(home), "teams"], env=env).output
    assert "ml: running 0, waiting 0, 0 unfinished job(s)" in shown and "max_running 2" in shown

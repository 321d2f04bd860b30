"""The account of every action (`bonsai history`): each change one row, with its actor, filtered as
asked, never rewritten."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner, Result

from pipeline.app.cli import cli
from pipeline.core.errors import InputError
from pipeline.core.settings import Settings
from pipeline.core.states import StageName
from pipeline.db import actions
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import JobRequest, cancel_job, create_jobs, retry_job
from pipeline.stages.sources import SourcePolicy


def _bonsai(home: Path, *args: str) -> Result:
    return CliRunner().invoke(cli, ["--home", str(home), *args], catch_exceptions=False)


def test_submit_retry_and_cancel_are_each_one_row(tmp_path: Path) -> None:
    home = tmp_path / "home"
    source = tmp_path / "no-weights"  # runs download and checksum, then fails at inspect
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    rt = build_runtime(Settings(home=home))
    policy = SourcePolicy.from_roots((), allow_any_local=True)
    with session_scope(rt.sessions) as session:
        (job_id,) = create_jobs(session, [JobRequest(str(source))], "cli:ana", policy)
    run_job(rt, job_id)
    with session_scope(rt.sessions) as session:
        retry_job(session, job_id, StageName.INSPECT, force=False, requested_by="cli:bo")
    run_job(rt, job_id)
    with session_scope(rt.sessions) as session:
        cancel_job(session, job_id, "cli:ana")
        with pytest.raises(InputError):
            cancel_job(session, job_id, "cli:bo")  # refused: already cancelled, and not recorded
    shown = json.loads(_bonsai(home, "history", "--json").output)
    assert [(row["action"], row["actor"], row["job_id"]) for row in shown] == [
        ("submit", "cli:ana", job_id), ("retry", "cli:bo", job_id), ("cancel", "cli:ana", job_id)]
    assert shown[1]["detail"]["from"] == "inspect" and shown[1]["detail"]["run_ids"]
    assert shown[0]["detail"]["source"] == str(source)
    only_bo = json.loads(_bonsai(home, "history", "--actor", "cli:bo", "--json").output)
    assert [row["action"] for row in only_bo] == ["retry"]
    assert json.loads(_bonsai(home, "history", "--job", str(job_id + 1), "--json").output) == []
    assert json.loads(_bonsai(home, "history", "--since", "2999-01-01", "--json").output) == []
    assert "cli:ana  submit  job 1  ok" in _bonsai(home, "history").output
    refused = _bonsai(home, "history", "--action", "delete")
    assert refused.exit_code != 0 and "not an action" in refused.output


def test_an_unknown_action_is_refused_and_an_unnamed_actor_is_unknown(tmp_path: Path) -> None:
    rt = build_runtime(Settings(home=tmp_path / "home"))
    with session_scope(rt.sessions) as session:
        with pytest.raises(ValueError, match="unknown action"):
            actions.record(session, "cli:ana", "delete", "job 1")
        row = actions.record(session, None, "gc", "store", detail={"removed": 0})
        assert (row.actor, row.team) == (actions.UNKNOWN_ACTOR, actions.UNKNOWN_ACTOR)
    with session_scope(rt.sessions) as session:
        assert [(r.action, r.target) for r in actions.history(session)] == [("gc", "store")]

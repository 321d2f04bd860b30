"""Embedded mode (`bonsai serve` without a broker) picks its next job with the fair-share chooser: a
second team's job runs before the rest of a first team's flood, whatever the flood's priority."""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import func, select

from pipeline.core.settings import Settings
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.job_control import JobRequest, create_jobs
from pipeline.orchestration.launcher import EmbeddedLauncher
from pipeline.stages.sources import SourcePolicy


def test_the_next_job_goes_to_the_team_that_has_had_least(tmp_path: Path) -> None:
    source = tmp_path / "no-weights"  # download and checksum, then inspect fails: a short job
    source.mkdir()
    (source / "config.json").write_text('{"model_type": "llama"}\n')
    settings = Settings(home=tmp_path / "home")
    rt = build_runtime(settings)
    policy = SourcePolicy.from_roots((), allow_any_local=True)
    with session_scope(rt.sessions) as session:
        flood = create_jobs(session, [JobRequest(str(source), priority=1_000_000)] * 3, "api:a", policy)
        (late,) = create_jobs(session, [JobRequest(str(source))], "api:b", policy)
    launcher = rt.launcher
    assert isinstance(launcher, EmbeddedLauncher)
    # Every job waits before the runner chooses its first (the condition's lock is reentrant).
    with launcher._changed:
        for job_id in (*flood, late):
            launcher.start(job_id)
    for job_id in (*flood, late):
        launcher.wait(job_id, timeout_s=60)
    launcher.shutdown()
    with session_scope(rt.sessions) as session:
        first_runs = session.execute(select(StageRun.job_id, func.min(StageRun.id)).group_by(StageRun.job_id))
        order = [job_id for job_id, _ in sorted(first_runs, key=lambda row: row[1])]
    # The flood's first job ran first (the tie between two idle teams goes by name); then team b, which
    # had used nothing, before the flood's other two.
    assert order == [flood[0], late, flood[1], flood[2]]

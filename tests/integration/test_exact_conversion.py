"""Work nobody reads is not done (issue 25, items 3-5): an exact conversion never runs the source.

Real jobs in embedded mode (SQLite, in-process, llama.cpp for validate and calibrate) on the demo
checkpoint, whose linear weights are exactly ternary: by default its BF16 embedding and head stay BF16
(issue 39), the conversion is bit-exact, so calibrate is recorded as not needed and validate runs the
file alone; with an F16 embedding (asked for, or a target without BF16) it is lossy, and calibrate
runs after package, before validate.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import select

from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageName
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.job_control import retry_job
from pipeline.orchestration.runtime import Runtime

pytestmark = [pytest.mark.llama, pytest.mark.slow]

EXACT: dict[str, str] = {}  # the default
LOSSY = {"embed_type": "F16", "output_type": "F16"}


def _job(rt: Runtime, source: Path, options: dict[str, str]) -> int:
    with session_scope(rt.sessions) as session:
        return repo.create_job(session, str(source), "tq2_0", options).id


def _runs(rt: Runtime, job_id: int) -> list[StageRun]:
    with session_scope(rt.sessions) as session:
        runs = list(session.scalars(select(StageRun).where(StageRun.job_id == job_id).order_by(StageRun.id)))
        for run in runs:
            _ = [link.name for link in run.links]  # loaded while the session is open
        return runs


def _inputs(run: StageRun) -> set[str]:
    return {link.name for link in run.links if link.direction == "in"}


@pytest.fixture(scope="module")
def rt(tmp_path_factory: pytest.TempPathFactory) -> Runtime:
    return build_runtime(Settings(home=tmp_path_factory.mktemp("exact") / "home"))


def test_an_exact_conversion_never_runs_the_source(rt: Runtime, demo_checkpoint: Path) -> None:
    job_id = _job(rt, demo_checkpoint, EXACT)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    runs = {StageName(run.stage): run for run in _runs(rt, job_id)}
    assert runs[StageName.DECOMPOSE].metrics["exact"] is True
    calibrate = runs[StageName.CALIBRATE]
    assert calibrate.status == "not-needed"
    assert "proved the conversion exact" in calibrate.metrics["not_needed"]
    assert calibrate.started_at is None and not calibrate.links  # nothing ran, nothing was stored
    validate = runs[StageName.VALIDATE]
    assert not any(name.startswith("calibrate/") for name in _inputs(validate))
    agreement = validate.metrics["agreement"]
    assert agreement["verdict"] == "pass" and agreement["measured"] is False
    assert agreement["reason"].startswith("not measured: weights bit-exact")
    # Decompose ran before calibrate's turn came: it never waited for the source.
    assert runs[StageName.DECOMPOSE].id < calibrate.id

    # A retry from calibrate runs it, then validate scores against the source; nothing else re-opens.
    with session_scope(rt.sessions) as session:
        reopened = retry_job(session, job_id, StageName.CALIBRATE, force=False)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    again = [run for run in _runs(rt, job_id) if run.id in reopened]
    assert sorted(run.stage for run in again) == ["calibrate", "validate"]
    assert all(run.status in ("succeeded", "skipped-cached") for run in again)


def test_a_lossy_conversion_runs_calibrate_after_package(rt: Runtime, demo_checkpoint: Path) -> None:
    job_id = _job(rt, demo_checkpoint, LOSSY)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    runs = {StageName(run.stage): run for run in _runs(rt, job_id)}
    assert runs[StageName.DECOMPOSE].metrics["exact"] is False
    assert runs[StageName.CALIBRATE].status in ("succeeded", "skipped-cached")
    assert runs[StageName.PACKAGE].id < runs[StageName.CALIBRATE].id < runs[StageName.VALIDATE].id
    assert not any(name.startswith("calibrate/") for name in _inputs(runs[StageName.DECOMPOSE]))
    assert "calibrate/reference.npz" in _inputs(runs[StageName.VALIDATE])
    assert runs[StageName.VALIDATE].metrics["agreement"]["verdict"] == "pass"
    assert runs[StageName.VALIDATE].metrics["agreement"].get("measured") is not False


def test_stages_whose_inputs_are_ready_run_side_by_side(tmp_path: Path, demo_checkpoint: Path,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # After decompose, package and (for a lossy conversion) calibrate both have their inputs: with a
    # package held for a second, calibrate's source run happens meanwhile, on the pool's other thread.
    monkeypatch.setenv("BONSAI_TEST_PACKAGE_FAULT", "delay:1.5")
    settings = Settings(home=tmp_path / "home", stage_package="tests.support.fault_stages")
    rt = build_runtime(settings)
    job_id = _job(rt, demo_checkpoint, LOSSY)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    runs = {StageName(run.stage): run for run in _runs(rt, job_id)}
    calibrate, package = runs[StageName.CALIBRATE], runs[StageName.PACKAGE]
    assert calibrate.status == package.status == "succeeded"
    assert calibrate.started_at < package.finished_at and package.started_at < calibrate.finished_at
    # One at a time when the setting says so.
    rt = build_runtime(Settings(home=tmp_path / "one", stage_package="tests.support.fault_stages",
                                stage_threads=1))
    job_id = _job(rt, demo_checkpoint, LOSSY)
    assert run_job(rt, job_id) is JobState.SUCCEEDED
    runs = {StageName(run.stage): run for run in _runs(rt, job_id)}
    calibrate, package = runs[StageName.CALIBRATE], runs[StageName.PACKAGE]
    assert package.finished_at <= calibrate.started_at

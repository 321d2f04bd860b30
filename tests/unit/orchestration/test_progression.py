"""advance_job over a real SQLite database: every ready stage at once, and calibrate's early start."""

from __future__ import annotations

from pathlib import Path

import pytest

from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import StageRun
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime
from pipeline.orchestration.progression import Advance, advance_job
from pipeline.orchestration.runtime import Runtime

S = StageState
BEFORE_DECOMPOSE = (StageName.DOWNLOAD, StageName.CHECKSUM, StageName.INSPECT)


@pytest.fixture
def rt(tmp_path: Path) -> Runtime:
    return build_runtime(Settings(home=tmp_path / "home"))


def _advance(rt: Runtime, job_id: int, spare_workers: bool) -> Advance:
    with session_scope(rt.sessions) as session:
        return advance_job(session, job_id, max_attempts=3, retry_base_s=0.0, spare_workers=spare_workers,
                           queue=spare_workers)


def _finish(rt: Runtime, run_id: int, state: StageState = S.SUCCEEDED, **fields: object) -> None:
    with session_scope(rt.sessions) as session:
        run = session.get_one(StageRun, run_id)
        if run.status in (S.PENDING.value, S.QUEUED.value):
            repo.set_stage_state(session, run, S.RUNNING)
        repo.set_stage_state(session, run, state, **fields)


def _job_past_inspect(rt: Runtime, spare_workers: bool) -> int:
    with session_scope(rt.sessions) as session:
        job_id = repo.create_job(session, "acme/model", "tq2_0", {}).id
    for stage in BEFORE_DECOMPOSE:
        (step,) = _advance(rt, job_id, spare_workers).ready
        assert step.stage is stage
        _finish(rt, step.run_id)
    return job_id


def test_with_spare_workers_calibrate_starts_beside_decompose(rt: Runtime) -> None:
    job_id = _job_past_inspect(rt, spare_workers=True)
    outcome = _advance(rt, job_id, spare_workers=True)
    # Decompose first: it is on the job's critical path; calibrate is read by validate only.
    assert [step.stage for step in outcome.ready] == [StageName.DECOMPOSE, StageName.CALIBRATE]
    assert all(step.task_id for step in outcome.ready)  # each queued under its own message
    # Asked again before either finished: nothing new, both in flight.
    again = _advance(rt, job_id, spare_workers=True)
    assert again.ready == ()
    assert {s.stage for s in again.in_flight} == {StageName.CALIBRATE, StageName.DECOMPOSE}
    decompose, calibrate = outcome.ready
    # Decompose proves the file exact while calibrate is still queued: calibrate is not needed and
    # package goes on; validate will not wait for the source.
    _finish(rt, decompose.run_id, metrics={"exact": True})
    after = _advance(rt, job_id, spare_workers=True)
    assert [step.stage for step in after.ready] == [StageName.PACKAGE]
    with session_scope(rt.sessions) as session:
        runs = repo.latest_runs(session, job_id)
        assert runs[StageName.CALIBRATE].status == S.NOT_NEEDED.value
        assert runs[StageName.CALIBRATE].id == calibrate.run_id


def test_an_early_calibrate_failure_waits_for_the_verdict(rt: Runtime) -> None:
    job_id = _job_past_inspect(rt, spare_workers=True)
    decompose, calibrate = _advance(rt, job_id, spare_workers=True).ready
    _finish(rt, calibrate.run_id, S.FAILED, error_kind="fatal", error_message="the source does not load")
    # The verdict is not in: the job goes on.
    assert _advance(rt, job_id, spare_workers=True).final is None
    # Lossy: calibrate was needed after all, and its failure fails the job.
    _finish(rt, decompose.run_id, metrics={"exact": False})
    assert _advance(rt, job_id, spare_workers=True).final is JobState.FAILED
    # A stage finishing after its job ended queues nothing.
    assert _advance(rt, job_id, spare_workers=True) == Advance(final=JobState.FAILED)


def test_on_one_machine_calibrate_waits_for_the_verdict(rt: Runtime) -> None:
    job_id = _job_past_inspect(rt, spare_workers=False)
    (decompose,) = _advance(rt, job_id, spare_workers=False).ready
    assert decompose.stage is StageName.DECOMPOSE and decompose.task_id is None
    _finish(rt, decompose.run_id, metrics={"exact": False})
    # Lossy: package and calibrate both wait only for decompose now.
    assert [s.stage for s in _advance(rt, job_id, spare_workers=False).ready] == [
        StageName.PACKAGE, StageName.CALIBRATE]


def _refused(rt: Runtime, job_id: int, run_id: int, need_mb: int) -> None:
    _finish(rt, run_id, S.FAILED, error_kind="retryable", error_message=f"OutgrowsWorker: needs {need_mb} MB",
            metrics={"memory_need_bytes": need_mb << 20, "worker_cap_bytes": 1024 << 20})


def _worker(rt: Runtime, name: str, queues: list[str], cap_mb: int | None) -> None:
    with session_scope(rt.sessions) as session:
        repo.worker_started(session, name, "host", 1, queues, 1, cap_mb)


def _advance_with_workers(rt: Runtime, job_id: int) -> Advance:
    from datetime import timedelta

    from pipeline.db.models import utcnow

    with session_scope(rt.sessions) as session:
        return advance_job(session, job_id, max_attempts=2, retry_base_s=0.0, spare_workers=True, queue=True,
                           workers_since=utcnow() - timedelta(minutes=2))


def test_a_refused_attempt_waits_for_a_bigger_worker_without_counting(rt: Runtime) -> None:
    job_id = _job_past_inspect(rt, spare_workers=True)
    _worker(rt, "small@a", ["gpu"], 1024)
    _worker(rt, "big@b", ["gpu"], 8192)
    _worker(rt, "cpu@c", ["cpu"], None)  # serves another queue: no help
    decompose = next(s for s in _advance_with_workers(rt, job_id).ready if s.stage is StageName.DECOMPOSE)
    run_id = decompose.run_id
    for _ in range(4):  # well past max_attempts=2: refusals do not use the job's attempts up
        _refused(rt, job_id, run_id, need_mb=4096)
        outcome = _advance_with_workers(rt, job_id)
        assert outcome.final is None
        run_id = next(s.run_id for s in outcome.ready if s.stage is StageName.DECOMPOSE)


def test_a_refused_attempt_fails_at_once_when_no_worker_can_hold_it(rt: Runtime) -> None:
    job_id = _job_past_inspect(rt, spare_workers=True)
    _worker(rt, "small@a", ["gpu"], 1024)
    _worker(rt, "medium@b", ["gpu"], 2048)
    decompose = next(s for s in _advance_with_workers(rt, job_id).ready if s.stage is StageName.DECOMPOSE)
    _refused(rt, job_id, decompose.run_id, need_mb=4096)
    assert _advance_with_workers(rt, job_id).final is JobState.FAILED
    with session_scope(rt.sessions) as session:
        message = repo.get_job(session, job_id).error_message
    assert "needs about 4,096 MB" in message and "the largest cap is 2,048 MB" in message
    assert f"`bonsai retry {job_id}`" in message and "BONSAI_WORKER_MEMORY_MB of at least 4,097" in message

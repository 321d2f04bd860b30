"""`bonsai gc` in a loop beside running jobs (PostgreSQL, local store): the jobs lose nothing they need.

Two threads run jobs on one checkpoint, so every job after the first tries to reuse the previous
job's results — the bytes gc is taking at that moment, since that job has finished. A third
thread collects garbage without pause. Each job must still succeed, and its GGUF's chain must
hold no hole: every artifact is either in the store or recorded as released by gc.
"""

from __future__ import annotations

import threading
from pathlib import Path

import pytest

from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageState
from pipeline.db import repo
from pipeline.db.session import session_scope
from pipeline.orchestration.bootstrap import build_runtime, migrate_database
from pipeline.orchestration.embedded import run_job
from pipeline.orchestration.runtime import Runtime
from pipeline.orchestration.store_gc import GcRules, collect_garbage
from pipeline.provenance.audit import audit_artifact, job_gguf

pytestmark = pytest.mark.services

_JOBS_PER_THREAD = 3


def _run_jobs(rt: Runtime, source: Path, outcomes: list[tuple[int, JobState]]) -> None:
    for _ in range(_JOBS_PER_THREAD):
        with session_scope(rt.sessions) as session:
            job_id = repo.create_job(session, str(source), "tq2_0").id
        outcomes.append((job_id, run_job(rt, job_id)))


def test_gc_in_a_loop_beside_jobs_loses_nothing_they_need(pg_url: str, tmp_path: Path,
                                                           demo_checkpoint: Path) -> None:
    settings = Settings(home=tmp_path / "home", database_url=pg_url, retry_base_s=0.01)
    migrate_database(settings)
    rt = build_runtime(settings)
    outcomes: list[tuple[int, JobState]] = []
    runners = [threading.Thread(target=_run_jobs, args=(rt, demo_checkpoint, outcomes)) for _ in range(2)]
    removed, sweeps = [], 0
    for runner in runners:
        runner.start()
    while any(runner.is_alive() for runner in runners):
        with session_scope(rt.sessions) as session:
            removed += collect_garbage(session, rt.store, GcRules()).removed
        sweeps += 1
    for runner in runners:
        runner.join()

    assert len(outcomes) == 2 * _JOBS_PER_THREAD
    assert removed, f"gc never found anything to take in {sweeps} sweeps: the test raced nothing"
    with session_scope(rt.sessions) as session:
        for job_id, state in outcomes:
            runs = repo.get_job(session, job_id).stage_runs
            failed = [(run.stage, run.error_message) for run in runs if run.status == StageState.FAILED]
            assert state is JobState.SUCCEEDED and not failed, (job_id, failed)
            report = audit_artifact(session, rt.store, job_gguf(session, job_id).sha256)
            assert report.is_ok, (job_id, report.problems[:3])

"""Which running equal-key run an attempt waits for instead of doing the same work again, and that in
embedded mode it starts again when that run ends (a condition, not a timer)."""

from __future__ import annotations

import threading
import time
from datetime import timedelta
from pathlib import Path

import pytest

from pipeline.core.settings import Settings
from pipeline.core.states import JobState, StageName, StageState
from pipeline.db import repo
from pipeline.db.models import utcnow
from pipeline.db.session import session_scope
from pipeline.orchestration import embedded, run_ends
from pipeline.orchestration.bootstrap import build_runtime

KEY = "ab" * 32


def _running(session, job, heartbeat_age_s: float):
    run = repo.new_attempt(session, job, StageName.DECOMPOSE)
    assert repo.claim_run(session, run.id, "host:1")
    session.refresh(run)
    run.cache_key = KEY
    run.heartbeat_at = utcnow() - timedelta(seconds=heartbeat_age_s)
    session.flush()
    return run


def test_waits_for_a_beating_run_and_for_a_parent_whose_shards_work(tmp_path: Path) -> None:
    rt = build_runtime(Settings(home=tmp_path))
    fresh_after = utcnow() - timedelta(seconds=120)
    with session_scope(rt.sessions) as session:
        job = repo.create_job(session, str(tmp_path / "ckpt"), "tq2_0")
        waiter = repo.new_attempt(session, job, StageName.DECOMPOSE)

        beating = _running(session, job, heartbeat_age_s=1)
        assert repo.running_with_key(session, KEY, waiter.id, fresh_after)

        repo.set_stage_state(session, beating, StageState.SUCCEEDED)
        silent = _running(session, job, heartbeat_age_s=600)
        assert not repo.running_with_key(session, KEY, waiter.id, fresh_after), "a silent run is lost"

        # A parent never beats (its shard children do): it counts as alive, as the reconciler judges it.
        repo.new_attempt(session, job, StageName.DECOMPOSE, shard="model-00001.safetensors", parent=silent)
        assert repo.running_with_key(session, KEY, waiter.id, fresh_after)
        assert not repo.running_with_key(session, KEY, silent.id, fresh_after), "never waits for itself"


def test_the_end_of_a_run_wakes_a_wait_that_began_after_its_mark() -> None:
    seen = run_ends.mark()
    assert run_ends.wait_after(seen, 0.05) is False, "nothing ended: the wait times out"
    timer = threading.Timer(0.2, run_ends.announce)
    timer.start()
    started = time.monotonic()
    assert run_ends.wait_after(seen, 30.0) is True
    assert time.monotonic() - started < 10.0
    # A run that ended between the mark and the wait is not missed.
    seen = run_ends.mark()
    run_ends.announce()
    assert run_ends.wait_after(seen, 0.0) is True


def test_an_attempt_deferred_behind_an_equal_run_of_this_process_starts_when_it_ends(
    tmp_path: Path, demo_checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Two jobs of one checkpoint in one process: each stage of the second waits for the first's equal
    # run. With the fallback for other processes at 60 s, only the condition can start them in time.
    monkeypatch.setattr(embedded, "_FOREIGN_RECHECK_S", 60.0)
    monkeypatch.setenv("BONSAI_TEST_PACKAGE_FAULT", "delay:1.0")
    rt = build_runtime(Settings(home=tmp_path / "home", stage_package="tests.support.fault_stages"))
    with session_scope(rt.sessions) as session:
        jobs = [repo.create_job(session, str(demo_checkpoint), "tq2_0", {}).id for _ in range(2)]
    states: dict[int, JobState] = {}
    threads = [threading.Thread(target=lambda j=j: states.setdefault(j, embedded.run_job(rt, j)))
               for j in jobs]
    started = time.monotonic()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=50.0)
    assert time.monotonic() - started < 50.0, "a deferred attempt waited for the fallback timeout"
    assert states == dict.fromkeys(jobs, JobState.SUCCEEDED)
    with session_scope(rt.sessions) as session:
        packages = [repo.latest_runs(session, j)[StageName.PACKAGE] for j in jobs]
        ran, reused = sorted(packages, key=lambda r: r.status != StageState.SUCCEEDED)
        assert (ran.status, reused.status) == (StageState.SUCCEEDED, StageState.SKIPPED_CACHED)
        # The reuse follows the equal run's end at once, not a polling period later.
        assert (reused.finished_at - ran.finished_at).total_seconds() < 0.9

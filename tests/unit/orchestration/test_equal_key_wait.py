"""Which running equal-key run an attempt waits for instead of doing the same work again."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

from pipeline.core.settings import Settings
from pipeline.core.states import StageName, StageState
from pipeline.db import repo
from pipeline.db.models import utcnow
from pipeline.db.session import session_scope
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

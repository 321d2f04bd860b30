"""One failed attempt gets exactly one retry, however many processes decide on it at once (PostgreSQL)."""

from __future__ import annotations

import threading

import pytest
from sqlalchemy import func, select

from pipeline.core.states import StageName, StageState
from pipeline.db import migrate, repo
from pipeline.db.models import StageRun
from pipeline.db.session import make_engine, make_sessionmaker, session_scope

pytestmark = pytest.mark.services


def test_two_deciders_at_once_make_one_retry(pg_url: str) -> None:
    engine = make_engine(pg_url)
    migrate.upgrade(engine)
    sessions = make_sessionmaker(engine)
    with session_scope(sessions) as session:
        job = repo.create_job(session, "org/name", "tq2_0", {}, 0, "test")
        failed = repo.new_attempt(session, job, StageName.DECOMPOSE)
        repo.set_stage_state(session, failed, StageState.FAILED, error_kind="retryable",
                             error_message="worker lost: test")
        failed_id = failed.id
    first = sessions()
    made_first = repo.retry_attempt(first, first.get_one(StageRun, failed_id))
    assert made_first is not None  # not committed yet: the second decider races it
    results: list[object] = []

    def second() -> None:
        with session_scope(sessions) as session:
            results.append(repo.retry_attempt(session, session.get_one(StageRun, failed_id)))

    thread = threading.Thread(target=second)
    thread.start()
    thread.join(timeout=1.0)
    assert thread.is_alive(), "the second insert waits on the first's unique key"
    first.commit()
    first.close()
    thread.join(timeout=30)
    assert results == [None]
    with session_scope(sessions) as session:
        query = select(func.count()).select_from(StageRun).where(StageRun.retry_of_id == failed_id)
        count = session.scalar(query)
        assert count == 1
        assert repo.retry_attempt(session, session.get_one(StageRun, failed_id)) is None
    engine.dispose()

"""Migrations and models agree, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

from pathlib import Path

import pytest
from sqlalchemy import inspect

from pipeline.db import migrate
from pipeline.db.session import make_engine

TABLES = {"jobs", "stage_runs", "artifacts", "run_artifacts", "provenance", "alembic_version"}


def _check(url: str) -> None:
    engine = make_engine(url)
    try:
        migrate.upgrade(engine)
        assert TABLES <= set(inspect(engine).get_table_names())
        assert migrate.schema_drift(engine) == []
        migrate.upgrade(engine)  # a second upgrade is a no-op
        migrate.downgrade(engine, "base")
        assert set(inspect(engine).get_table_names()) <= {"alembic_version"}
        migrate.upgrade(engine)
        assert migrate.schema_drift(engine) == []
    finally:
        engine.dispose()


def test_sqlite_migrations_match_models(tmp_path: Path) -> None:
    _check(f"sqlite:///{tmp_path / 'bonsai.db'}")


@pytest.mark.services
def test_postgres_migrations_match_models(pg_url: str) -> None:
    _check(pg_url)


def test_drift_is_detected_when_models_change(tmp_path: Path) -> None:
    engine = make_engine(f"sqlite:///{tmp_path / 'bonsai.db'}")
    migrate.upgrade(engine, "base")  # nothing applied: every table is missing
    assert migrate.schema_drift(engine), "an empty database must differ from the models"
    engine.dispose()

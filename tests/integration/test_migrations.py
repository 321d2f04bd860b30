"""Migrations and models agree, on SQLite and on the real PostgreSQL server."""

from __future__ import annotations

from pathlib import Path
from typing import Any

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


def _schema(engine: Any) -> dict[str, Any]:
    """Every table's columns, keys, indexes and unique constraints, order-free."""
    seen = inspect(engine)
    schema: dict[str, Any] = {}
    for table in seen.get_table_names():
        schema[table] = {
            "columns": {c["name"]: (str(c["type"]), c["nullable"], c.get("default"))
                        for c in seen.get_columns(table)},
            "primary_key": sorted(seen.get_pk_constraint(table)["constrained_columns"]),
            "foreign_keys": sorted((tuple(fk["constrained_columns"]), fk["referred_table"],
                                    tuple(fk["referred_columns"]), str(fk.get("options")))
                                   for fk in seen.get_foreign_keys(table)),
            "indexes": sorted((ix["name"], tuple(ix["column_names"]), bool(ix["unique"]))
                              for ix in seen.get_indexes(table)),
            "unique": sorted(tuple(u["column_names"]) for u in seen.get_unique_constraints(table)),
        }
    return schema


def test_a_new_sqlite_file_gets_exactly_the_migrated_schema(tmp_path: Path) -> None:
    migrated, created = (make_engine(f"sqlite:///{tmp_path / name}") for name in ("old.db", "new.db"))
    try:
        migrate.upgrade(migrated)
        assert migrate.create_current(created)
        assert TABLES <= set(_schema(created))
        assert _schema(created) == _schema(migrated)
        assert migrate.is_current(created) and migrate.schema_drift(created) == []
        assert not migrate.create_current(created)  # not empty any more: left to the migrations
        assert not migrate.create_current(migrated)
        migrate.upgrade(created)  # Alembic takes the stamped file as current: nothing to apply
        assert _schema(created) == _schema(migrated)
    finally:
        migrated.dispose()
        created.dispose()

"""Alembic environment: metadata from pipeline.db.models, URL from the caller's config."""

from __future__ import annotations

from alembic import context

from pipeline.db.models import Base
from pipeline.db.session import make_engine

config = context.config
target_metadata = Base.metadata


def _run_offline() -> None:
    context.configure(
        url=config.get_main_option("sqlalchemy.url"),
        target_metadata=target_metadata,
        literal_binds=True,
        render_as_batch=True,
    )
    with context.begin_transaction():
        context.run_migrations()


def _run_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        _configure_and_run(connection)
        return
    engine = make_engine(config.get_main_option("sqlalchemy.url") or "")
    with engine.connect() as conn:
        _configure_and_run(conn)
    engine.dispose()


def _configure_and_run(connection) -> None:  # type: ignore[no-untyped-def]
    # Batch mode lets SQLite apply ALTERs by copying tables.
    context.configure(connection=connection, target_metadata=target_metadata, render_as_batch=True)
    with context.begin_transaction():
        context.run_migrations()


if context.is_offline_mode():
    _run_offline()
else:
    _run_online()

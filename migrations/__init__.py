"""Alembic migrations; `pipeline.db.migrate` runs them."""

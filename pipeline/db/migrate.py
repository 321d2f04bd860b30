"""Apply Alembic migrations and compare the models against a migrated database.

Alembic (and the Mako and Pygments it loads, ~0.4 s) is imported only when a migration runs:
`is_current` tells whether a database is already at the newest revision by reading the
migration files' ``revision``/``down_revision`` lines and the ``alembic_version`` row, so a
process that finds its schema current never loads it (issue 14). A new, empty database gets the
models' tables and the scripts' head revision directly (`create_current`): the schema the
migrations build, which the tests compare table by table, without loading Alembic at all.
"""

from __future__ import annotations

import functools
import re
from pathlib import Path
from typing import TYPE_CHECKING

from sqlalchemy import Engine, inspect, text

if TYPE_CHECKING:
    from alembic.config import Config

__all__ = ["alembic_config", "upgrade", "downgrade", "schema_drift", "script_head", "current_revision",
           "is_current", "create_current"]

_MIGRATIONS_DIR = Path(__file__).resolve().parents[2] / "migrations"
_REVISION = re.compile(r"^revision\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]\s*$", re.MULTILINE)
_DOWN_REVISION = re.compile(r"^down_revision\s*(?::[^=]*)?=\s*(None|['\"]([^'\"]+)['\"])\s*$", re.MULTILINE)


def alembic_config(url: str) -> Config:
    """An Alembic Config that needs no alembic.ini on disk."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(_MIGRATIONS_DIR))
    cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    return cfg


def upgrade(engine: Engine, revision: str = "head") -> None:
    """Bring the database behind `engine` up to `revision`."""
    from alembic import command

    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.upgrade(cfg, revision)


def downgrade(engine: Engine, revision: str) -> None:
    """Take the database behind `engine` back down to `revision` ("base" drops everything)."""
    from alembic import command

    cfg = alembic_config(engine.url.render_as_string(hide_password=False))
    with engine.begin() as connection:
        cfg.attributes["connection"] = connection
        command.downgrade(cfg, revision)


def schema_drift(engine: Engine) -> list[object]:
    """Differences autogenerate finds between the models and the live schema ([] when equal)."""
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from pipeline.db.models import Base

    with engine.connect() as connection:
        context = MigrationContext.configure(connection, opts={"compare_type": True})
        return list(compare_metadata(context, Base.metadata))


@functools.cache
def script_head(versions: Path = _MIGRATIONS_DIR / "versions") -> str | None:
    """The newest revision of the migration scripts, read from their text without Alembic.

    None when the scripts are not one straight line this reader understands (a merge, a
    branch, a revision it cannot parse): the caller then asks Alembic.
    """
    parents: dict[str, str | None] = {}
    for script in sorted(versions.glob("*.py")):
        source = script.read_text(encoding="utf-8")
        revision, down = _REVISION.findall(source), _DOWN_REVISION.findall(source)
        if len(revision) != 1 or len(down) != 1 or revision[0] in parents:
            return None
        parents[revision[0]] = down[0][1] or None
    heads = set(parents) - set(parents.values())
    roots = [rev for rev, parent in parents.items() if parent is None]
    dangling = any(p is not None and p not in parents for p in parents.values())
    if len(heads) != 1 or len(roots) != 1 or dangling:
        return None
    return heads.pop()


def current_revision(engine: Engine) -> str | None:
    """The revision stored in the database's ``alembic_version`` table; None when there is none."""
    with engine.connect() as connection:  # an unreachable server raises here, as it would in Alembic
        if not inspect(connection).has_table("alembic_version"):
            return None
        rows = connection.execute(text("SELECT version_num FROM alembic_version")).scalars().all()
    return str(rows[0]) if len(rows) == 1 else None


def is_current(engine: Engine) -> bool:
    """True when the database is at the scripts' newest revision (no migration to run)."""
    head = script_head()
    if head is None:
        from alembic.script import ScriptDirectory

        head = ScriptDirectory.from_config(alembic_config(str(engine.url))).get_current_head()
    return head is not None and current_revision(engine) == head


def create_current(engine: Engine) -> bool:
    """On an empty database: create the models' tables and stamp the scripts' newest revision.

    Returns False, touching nothing, when the database has any table or the scripts' head cannot
    be read without Alembic; the caller then migrates (`upgrade`).
    """
    from pipeline.db.models import Base

    head = script_head()
    if head is None:
        return False
    with engine.begin() as connection:
        if inspect(connection).get_table_names():
            return False
        Base.metadata.create_all(connection)
        connection.execute(text("CREATE TABLE alembic_version (version_num VARCHAR(32) NOT NULL, "
                                "CONSTRAINT alembic_version_pkc PRIMARY KEY (version_num))"))
        connection.execute(text("INSERT INTO alembic_version (version_num) VALUES (:head)"), {"head": head})
    return True

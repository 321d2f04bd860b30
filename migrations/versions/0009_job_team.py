"""every job belongs to its submitter's team, which fair share and the team caps count by

Revision ID: 0009
Revises: 0008
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0009"
down_revision: str | None = "0008"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("team", sa.String(length=256), nullable=False, server_default="unknown"))
        batch_op.create_index(batch_op.f("ix_jobs_team"), ["team"], unique=False)
    # Before teams, each submitter was a team of its own.
    op.execute("UPDATE jobs SET team = submitted_by WHERE submitted_by IS NOT NULL")


def downgrade() -> None:
    with op.batch_alter_table("jobs", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_jobs_team"))
        batch_op.drop_column("team")

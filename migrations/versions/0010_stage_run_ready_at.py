"""an attempt whose inputs are done records when, and waits in the database for a slot (admission)

Revision ID: 0010
Revises: 0009
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0010"
down_revision: str | None = "0009"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("ready_at", sa.DateTime(timezone=True), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.drop_column("ready_at")

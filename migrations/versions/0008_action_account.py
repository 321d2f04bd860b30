"""an account of every state-changing action: who, which team, when, on what, with what outcome

Revision ID: 0008
Revises: 0007
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0008"
down_revision: str | None = "0007"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table(
        "actions",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("actor", sa.String(length=256), nullable=False),
        sa.Column("team", sa.String(length=256), nullable=False),
        sa.Column("action", sa.String(length=16), nullable=False),
        sa.Column("target", sa.String(length=256), nullable=False),
        sa.Column("job_id", sa.Integer(), nullable=True),
        sa.Column("outcome", sa.String(length=1024), nullable=False),
        sa.Column("detail", sa.JSON(), nullable=False),
        sa.PrimaryKeyConstraint("id"),
    )
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_actions_action"), ["action"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_actor"), ["actor"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_at"), ["at"], unique=False)
        batch_op.create_index(batch_op.f("ix_actions_job_id"), ["job_id"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("actions", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_actions_job_id"))
        batch_op.drop_index(batch_op.f("ix_actions_at"))
        batch_op.drop_index(batch_op.f("ix_actions_actor"))
        batch_op.drop_index(batch_op.f("ix_actions_action"))
    op.drop_table("actions")

"""worker heartbeats; one retry per failed attempt

Revision ID: 0003
Revises: 0002
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0003"
down_revision: str | None = "0002"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("retry_of_id", sa.Integer(), nullable=True))
        batch_op.create_unique_constraint("uq_stage_runs_retry_of_id", ["retry_of_id"])
        batch_op.create_foreign_key("fk_stage_runs_retry_of_id_stage_runs", "stage_runs", ["retry_of_id"], ["id"])
    op.create_table(
        "workers",
        sa.Column("name", sa.String(length=256), nullable=False),
        sa.Column("hostname", sa.String(length=256), nullable=False),
        sa.Column("pid", sa.Integer(), nullable=False),
        sa.Column("queues", sa.JSON(), nullable=False),
        sa.Column("concurrency", sa.Integer(), nullable=False),
        sa.Column("held_task_ids", sa.JSON(), nullable=False),
        sa.Column("started_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("heartbeat_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("stopped_at", sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint("name"),
    )


def downgrade() -> None:
    op.drop_table("workers")
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.drop_constraint("fk_stage_runs_retry_of_id_stage_runs", type_="foreignkey")
        batch_op.drop_constraint("uq_stage_runs_retry_of_id", type_="unique")
        batch_op.drop_column("retry_of_id")

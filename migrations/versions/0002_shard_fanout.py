"""stage runs can fan out by source shard

Revision ID: 0002
Revises: 0001
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0002"
down_revision: str | None = "0001"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.add_column(sa.Column("shard", sa.String(length=512), server_default="", nullable=False))
        batch_op.add_column(sa.Column("parent_run_id", sa.Integer(), nullable=True))
        batch_op.create_index(batch_op.f("ix_stage_runs_parent_run_id"), ["parent_run_id"], unique=False)
        batch_op.create_foreign_key(
            "fk_stage_runs_parent_run_id_stage_runs", "stage_runs", ["parent_run_id"], ["id"]
        )
        batch_op.drop_constraint("uq_stage_runs_job_stage_attempt", type_="unique")
        batch_op.create_unique_constraint(
            "uq_stage_runs_job_stage_shard_attempt", ["job_id", "stage", "shard", "attempt"]
        )


def downgrade() -> None:
    with op.batch_alter_table("stage_runs", schema=None) as batch_op:
        batch_op.drop_constraint("uq_stage_runs_job_stage_shard_attempt", type_="unique")
        batch_op.create_unique_constraint("uq_stage_runs_job_stage_attempt", ["job_id", "stage", "attempt"])
        batch_op.drop_constraint("fk_stage_runs_parent_run_id_stage_runs", type_="foreignkey")
        batch_op.drop_index(batch_op.f("ix_stage_runs_parent_run_id"))
        batch_op.drop_column("parent_run_id")
        batch_op.drop_column("shard")

"""the store can forget: artifacts record when gc released their bytes; pins hold bytes

Revision ID: 0006
Revises: 0005
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = "0006"
down_revision: str | None = "0005"
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.add_column(sa.Column("released_at", sa.DateTime(timezone=True), nullable=True))
    op.create_table(
        "pins",
        sa.Column("id", sa.Integer(), autoincrement=True, nullable=False),
        sa.Column("artifact_sha256", sa.String(length=64), nullable=False),
        sa.Column("reason", sa.String(length=16), nullable=False),
        sa.Column("note", sa.String(length=1024), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.ForeignKeyConstraint(["artifact_sha256"], ["artifacts.sha256"]),
        sa.PrimaryKeyConstraint("id"),
        sa.UniqueConstraint("artifact_sha256", "reason", "note", name="uq_pins_artifact_reason_note"),
    )
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.create_index(batch_op.f("ix_pins_artifact_sha256"), ["artifact_sha256"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("pins", schema=None) as batch_op:
        batch_op.drop_index(batch_op.f("ix_pins_artifact_sha256"))
    op.drop_table("pins")
    with op.batch_alter_table("artifacts", schema=None) as batch_op:
        batch_op.drop_column("released_at")

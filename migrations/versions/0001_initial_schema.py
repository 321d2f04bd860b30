"""initial schema

Revision ID: 0001
Revises:
"""

from __future__ import annotations

from collections.abc import Sequence

import sqlalchemy as sa
from alembic import op

revision: str = '0001'
down_revision: str | None = None
branch_labels: str | Sequence[str] | None = None
depends_on: str | Sequence[str] | None = None


def upgrade() -> None:
    op.create_table('jobs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('source', sa.String(length=2048), nullable=False),
    sa.Column('resolved_revision', sa.String(length=64), nullable=True),
    sa.Column('recipe', sa.String(length=64), nullable=False),
    sa.Column('params', sa.JSON(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('priority', sa.Integer(), nullable=False),
    sa.Column('submitted_by', sa.String(length=256), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_jobs_status'), ['status'], unique=False)

    op.create_table('stage_runs',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('job_id', sa.Integer(), nullable=False),
    sa.Column('stage', sa.String(length=32), nullable=False),
    sa.Column('attempt', sa.Integer(), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('worker_host', sa.String(length=256), nullable=True),
    sa.Column('device', sa.String(length=64), nullable=True),
    sa.Column('task_id', sa.String(length=64), nullable=True),
    sa.Column('cache_key', sa.String(length=64), nullable=True),
    sa.Column('cached_from_id', sa.Integer(), nullable=True),
    sa.Column('is_forced', sa.Boolean(), nullable=False),
    sa.Column('error_kind', sa.String(length=16), nullable=True),
    sa.Column('error_message', sa.Text(), nullable=True),
    sa.Column('error_traceback', sa.Text(), nullable=True),
    sa.Column('metrics', sa.JSON(), nullable=False),
    sa.Column('warnings', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('queued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('heartbeat_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.ForeignKeyConstraint(['cached_from_id'], ['stage_runs.id'], ),
    sa.ForeignKeyConstraint(['job_id'], ['jobs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('job_id', 'stage', 'attempt', name='uq_stage_runs_job_stage_attempt')
    )
    with op.batch_alter_table('stage_runs', schema=None) as batch_op:
        batch_op.create_index('ix_stage_runs_cache_key', ['cache_key'], unique=False)
        batch_op.create_index(batch_op.f('ix_stage_runs_job_id'), ['job_id'], unique=False)
        batch_op.create_index('ix_stage_runs_status', ['status'], unique=False)

    op.create_table('artifacts',
    sa.Column('sha256', sa.String(length=64), nullable=False),
    sa.Column('kind', sa.String(length=64), nullable=False),
    sa.Column('size_bytes', sa.BigInteger(), nullable=False),
    sa.Column('uri', sa.String(length=2048), nullable=False),
    sa.Column('media_type', sa.String(length=128), nullable=False),
    sa.Column('created_by_run_id', sa.Integer(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['created_by_run_id'], ['stage_runs.id'], ),
    sa.PrimaryKeyConstraint('sha256')
    )
    op.create_table('provenance',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('artifact_sha256', sa.String(length=64), nullable=False),
    sa.Column('stage_run_id', sa.Integer(), nullable=False),
    sa.Column('statement', sa.JSON(), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['artifact_sha256'], ['artifacts.sha256'], ),
    sa.ForeignKeyConstraint(['stage_run_id'], ['stage_runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('artifact_sha256', 'stage_run_id', name='uq_provenance_artifact_run')
    )
    with op.batch_alter_table('provenance', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_provenance_artifact_sha256'), ['artifact_sha256'], unique=False)

    op.create_table('run_artifacts',
    sa.Column('stage_run_id', sa.Integer(), nullable=False),
    sa.Column('direction', sa.String(length=3), nullable=False),
    sa.Column('name', sa.String(length=1024), nullable=False),
    sa.Column('artifact_sha256', sa.String(length=64), nullable=False),
    sa.ForeignKeyConstraint(['artifact_sha256'], ['artifacts.sha256'], ),
    sa.ForeignKeyConstraint(['stage_run_id'], ['stage_runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('stage_run_id', 'direction', 'name')
    )
    with op.batch_alter_table('run_artifacts', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_run_artifacts_artifact_sha256'), ['artifact_sha256'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('run_artifacts', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_run_artifacts_artifact_sha256'))

    op.drop_table('run_artifacts')
    with op.batch_alter_table('provenance', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_provenance_artifact_sha256'))

    op.drop_table('provenance')
    op.drop_table('artifacts')
    with op.batch_alter_table('stage_runs', schema=None) as batch_op:
        batch_op.drop_index('ix_stage_runs_status')
        batch_op.drop_index(batch_op.f('ix_stage_runs_job_id'))
        batch_op.drop_index('ix_stage_runs_cache_key')

    op.drop_table('stage_runs')
    with op.batch_alter_table('jobs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_jobs_status'))

    op.drop_table('jobs')

"""training runs, leases and steps

Revision ID: 0003
Revises: 0002
Create Date: 2026-11-26
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0003'
down_revision = '0002'
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    op.create_table('training_runs',
    sa.Column('id', sa.String(length=64), nullable=False),
    sa.Column('objective', sa.String(length=16), nullable=False),
    sa.Column('backend', sa.String(length=16), nullable=False),
    sa.Column('config', JSON, nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('base_version', sa.String(length=256), nullable=True),
    sa.Column('produced_version', sa.String(length=256), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('finished_at', sa.DateTime(timezone=True), nullable=True),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_runs_status'), ['status'], unique=False)

    op.create_table('training_steps',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('step', sa.Integer(), nullable=False),
    sa.Column('metrics', JSON, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('training_steps', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_steps_run_id'), ['run_id'], unique=False)

    op.create_table('training_leases',
    sa.Column('run_id', sa.String(length=64), nullable=False),
    sa.Column('turn_id', sa.String(length=36), nullable=False),
    sa.Column('leased_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('expires_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('acked_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('step', sa.Integer(), nullable=True),
    sa.ForeignKeyConstraint(['run_id'], ['training_runs.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('run_id', 'turn_id')
    )
    with op.batch_alter_table('training_leases', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_training_leases_expires_at'), ['expires_at'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('training_leases', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_training_leases_expires_at'))

    op.drop_table('training_leases')
    with op.batch_alter_table('training_steps', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_training_steps_run_id'))

    op.drop_table('training_steps')
    with op.batch_alter_table('training_runs', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_training_runs_status'))

    op.drop_table('training_runs')

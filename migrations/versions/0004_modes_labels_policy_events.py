"""session modes, labels, policy events

Revision ID: 0004
Revises: 0003
Create Date: 2026-11-26
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0004'
down_revision = '0003'
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('mode', sa.String(length=16), server_default='online', nullable=False))
        batch_op.add_column(sa.Column('end_reason', sa.String(length=32), nullable=True))
        batch_op.create_index(batch_op.f('ix_sessions_mode'), ['mode'], unique=False)

    op.create_table('labels',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('turn_id', sa.String(length=36), nullable=True),
    sa.Column('session_id', sa.String(length=128), nullable=True),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('value', JSON, nullable=True),
    sa.Column('author', sa.String(length=256), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], ondelete='CASCADE'),
    sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('labels', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_labels_session_id'), ['session_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_labels_turn_id'), ['turn_id'], unique=False)

    op.create_table('policy_events',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('version_id', sa.Integer(), nullable=True),
    sa.Column('action', sa.String(length=16), nullable=False),
    sa.Column('actor', sa.String(length=256), nullable=False),
    sa.Column('reason', sa.Text(), nullable=True),
    sa.Column('metrics', JSON, nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['version_id'], ['policy_versions.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('policy_events', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_policy_events_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_policy_events_version_id'), ['version_id'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('policy_events', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_policy_events_version_id'))
        batch_op.drop_index(batch_op.f('ix_policy_events_created_at'))
    op.drop_table('policy_events')
    with op.batch_alter_table('labels', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_labels_turn_id'))
        batch_op.drop_index(batch_op.f('ix_labels_session_id'))
    op.drop_table('labels')
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sessions_mode'))
        batch_op.drop_column('end_reason')
        batch_op.drop_column('mode')

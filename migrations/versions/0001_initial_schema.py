"""initial schema

Revision ID: 0001
Revises: 
Create Date: 2026-11-26
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0001'
down_revision = None
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    op.create_table('policy_versions',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('name', sa.String(length=256), nullable=False),
    sa.Column('base_model', sa.String(length=256), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('path', sa.String(length=1024), nullable=True),
    sa.Column('parent_id', sa.Integer(), nullable=True),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('stats', JSON, nullable=False),
    sa.ForeignKeyConstraint(['parent_id'], ['policy_versions.id'], ),
    sa.PrimaryKeyConstraint('id'),
    sa.UniqueConstraint('name')
    )
    with op.batch_alter_table('policy_versions', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_policy_versions_status'), ['status'], unique=False)

    op.create_table('sessions',
    sa.Column('id', sa.String(length=128), nullable=False),
    sa.Column('source', sa.String(length=16), nullable=False),
    sa.Column('task_id', sa.String(length=256), nullable=True),
    sa.Column('group_id', sa.String(length=256), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('ended_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('metadata', JSON, nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.create_index('ix_sessions_created_at_id', ['created_at', 'id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sessions_group_id'), ['group_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_sessions_task_id'), ['task_id'], unique=False)

    op.create_table('turns',
    sa.Column('id', sa.String(length=36), nullable=False),
    sa.Column('session_id', sa.String(length=128), nullable=False),
    sa.Column('parent_turn_id', sa.String(length=36), nullable=True),
    sa.Column('turn_type', sa.String(length=8), nullable=False),
    sa.Column('endpoint', sa.String(length=16), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.Column('model', sa.String(length=256), nullable=False),
    sa.Column('upstream_model', sa.String(length=256), nullable=True),
    sa.Column('policy_version', sa.String(length=256), nullable=True),
    sa.Column('capture', sa.String(length=16), nullable=False),
    sa.Column('request', JSON, nullable=False),
    sa.Column('response', JSON, nullable=True),
    sa.Column('next_state', JSON, nullable=True),
    sa.Column('prompt_token_ids', JSON, nullable=True),
    sa.Column('token_ids', JSON, nullable=True),
    sa.Column('logprobs', JSON, nullable=True),
    sa.Column('latency_ms', sa.Float(), nullable=True),
    sa.Column('usage', JSON, nullable=True),
    sa.Column('error', JSON, nullable=True),
    sa.Column('link_hash', sa.String(length=64), nullable=True),
    sa.ForeignKeyConstraint(['session_id'], ['sessions.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_turns_created_at'), ['created_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_turns_link_hash'), ['link_hash'], unique=False)
        batch_op.create_index(batch_op.f('ix_turns_parent_turn_id'), ['parent_turn_id'], unique=False)
        batch_op.create_index(batch_op.f('ix_turns_policy_version'), ['policy_version'], unique=False)
        batch_op.create_index('ix_turns_session_created', ['session_id', 'created_at'], unique=False)

    op.create_table('turn_continuations',
    sa.Column('hash', sa.String(length=64), nullable=False),
    sa.Column('turn_id', sa.String(length=36), nullable=False),
    sa.Column('choice_index', sa.Integer(), nullable=False),
    sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('hash', 'turn_id', 'choice_index')
    )


def downgrade() -> None:
    op.drop_table('turn_continuations')
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_index('ix_turns_session_created')
        batch_op.drop_index(batch_op.f('ix_turns_policy_version'))
        batch_op.drop_index(batch_op.f('ix_turns_parent_turn_id'))
        batch_op.drop_index(batch_op.f('ix_turns_link_hash'))
        batch_op.drop_index(batch_op.f('ix_turns_created_at'))

    op.drop_table('turns')
    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_sessions_task_id'))
        batch_op.drop_index(batch_op.f('ix_sessions_group_id'))
        batch_op.drop_index('ix_sessions_created_at_id')

    op.drop_table('sessions')
    with op.batch_alter_table('policy_versions', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_policy_versions_status'))

    op.drop_table('policy_versions')

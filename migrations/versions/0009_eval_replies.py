"""eval_replies: each version's reply to each held-out prompt of the eval gate

The admin UI's version-vs-version page shows two versions' replies to the same held-out
prompts; until now the eval gate kept only the mean score (in the ``eval`` policy event).

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-27
"""

import sqlalchemy as sa
from alembic import op
from sqlalchemy.dialects import postgresql

revision = '0009'
down_revision = '0008'
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    op.create_table('eval_replies',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('version', sa.String(length=256), nullable=False),
    sa.Column('prompt_hash', sa.String(length=64), nullable=False),
    sa.Column('prompt', JSON, nullable=False),
    sa.Column('reply', sa.Text(), nullable=False),
    sa.Column('score', sa.Float(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('eval_replies', schema=None) as batch_op:
        batch_op.create_index('ix_eval_replies_version_prompt', ['version', 'prompt_hash'], unique=False)


def downgrade() -> None:
    with op.batch_alter_table('eval_replies', schema=None) as batch_op:
        batch_op.drop_index('ix_eval_replies_version_prompt')
    op.drop_table('eval_replies')

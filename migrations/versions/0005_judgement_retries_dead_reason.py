"""judgements: retries and dead_reason

Revision ID: 0005
Revises: 0004
Create Date: 2026-11-27
"""

from alembic import op
import sqlalchemy as sa

revision = '0005'
down_revision = '0004'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('judgements', schema=None) as batch_op:
        batch_op.add_column(sa.Column('retries', sa.Integer(), server_default='0', nullable=False))
        batch_op.add_column(sa.Column('dead_reason', sa.String(length=32), nullable=True))


def downgrade() -> None:
    with op.batch_alter_table('judgements', schema=None) as batch_op:
        batch_op.drop_column('dead_reason')
        batch_op.drop_column('retries')

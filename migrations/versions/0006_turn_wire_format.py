"""turns.wire_format: the API the client spoke (chat, completions, responses, messages)

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-27
"""

from alembic import op
import sqlalchemy as sa

revision = '0006'
down_revision = '0005'
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('wire_format', sa.String(length=16), server_default='chat', nullable=False))
    # every turn stored before this revision came in over its own endpoint
    op.execute("UPDATE turns SET wire_format = endpoint")


def downgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_column('wire_format')

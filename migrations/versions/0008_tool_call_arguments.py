"""tool_call_arguments: the model's own arguments text of each tool call answered on /v1/messages

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-27
"""

from alembic import op
import sqlalchemy as sa

revision = '0008'
down_revision = '0007'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        'tool_call_arguments',
        sa.Column('id', sa.String(length=256), nullable=False),
        sa.Column('turn_id', sa.String(length=36), nullable=False),
        sa.Column('arguments', sa.Text(), nullable=False),
        sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index(op.f('ix_tool_call_arguments_turn_id'), 'tool_call_arguments', ['turn_id'], unique=False)


def downgrade() -> None:
    op.drop_index(op.f('ix_tool_call_arguments_turn_id'), table_name='tool_call_arguments')
    op.drop_table('tool_call_arguments')

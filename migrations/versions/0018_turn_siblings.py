"""turns.sibling_of: shadow siblings, alternative replies resampled from a main turn's exact
prompt ids and scored against its next state, so one online turn gets a group to compare its
reward with

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = '0018'
down_revision = '0017'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMN (no batch copy of the table on SQLite: its triggers, migration 0010, stay)
    op.add_column('turns', sa.Column('sibling_of', sa.String(length=36), nullable=True))
    op.create_index('ix_turns_sibling_of', 'turns', ['sibling_of'])


def downgrade() -> None:
    op.drop_index('ix_turns_sibling_of', table_name='turns')
    op.execute("ALTER TABLE turns DROP COLUMN sibling_of")

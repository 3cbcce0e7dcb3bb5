"""turns.edit: how a turn continues its parent when the agent edited its history (a recovery pass,
a summary inserted or in place of earlier messages, a fork, a retry, a summarisation side turn);
and every stored turn's reply pairs and request tail, by which such a request finds the turn it continues

Revision ID: 0019
Revises: 0018
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa

revision = '0019'
down_revision = '0018'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMN (no batch copy of the table on SQLite: its triggers, migration 0010, stay)
    op.add_column('turns', sa.Column('edit', sa.String(length=24), nullable=True))
    from datapool.sessions import rehash

    rehash(op.get_bind())


def downgrade() -> None:
    op.execute("ALTER TABLE turns DROP COLUMN edit")
    # the reply pairs and request tails (datapool.edits.is_pair_index)
    op.execute("DELETE FROM turn_continuations WHERE choice_index <= -999")

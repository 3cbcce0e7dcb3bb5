"""rehash turns with the canonical form that tolerates client rewrites

Tool-call ids are matched by position, arguments as the JSON they encode, `name` ignored
(docs/sessions.md). The stored link hashes and continuations were computed with the earlier
form; recomputed here so that requests continuing turns stored before the upgrade still find
them. No schema change.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-27
"""

from alembic import op

revision = '0007'
down_revision = '0006'
branch_labels = None
depends_on = None


def upgrade() -> None:
    from datapool.sessions import rehash

    rehash(op.get_bind())


def downgrade() -> None:
    # The earlier form's code is not here to recompute its hashes; after a downgrade, turns
    # stored so far are continued only by requests matching them under the new form.
    pass

"""rehash the eval gate's held-out prompts with the canonical history hash

``eval_replies.prompt_hash`` was the SHA-256 of the prompt's JSON as stored; it is now the
canonical history hash that stitches sessions (``datapool.canonical.history_hash``), so the
version-vs-version page pairs a prompt with itself whatever a client's spelling of it. Recomputed
here from each row's stored prompt. No schema change.

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-27
"""

from alembic import op

revision = '0011'
down_revision = '0010'
branch_labels = None
depends_on = None


def upgrade() -> None:
    from datapool.evals import rehash

    rehash(op.get_bind())


def downgrade() -> None:
    # The earlier hash is not recomputed: after a downgrade, rows stored so far keep the new
    # hash and pair only with each other (the page shows a prompt twice, nothing is lost).
    pass

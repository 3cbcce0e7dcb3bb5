"""rehash turns and eval prompts with the canonical form that leaves out <system-reminder> blocks

The text an agent wraps in ``<system-reminder>`` (Claude Code, Qwen Code) is no longer part of a
message's canonical form (docs/sessions.md): Qwen Code's `--continue` resends the transcript
without the reminders its first call carried. The stored link hashes, continuations and the eval
gate's prompt hashes were computed with the reminders; recomputed here so that requests
continuing turns stored before the upgrade still find them. No schema change.

Revision ID: 0017
Revises: 0016
Create Date: 2026-11-28
"""

from alembic import op

revision = '0017'
down_revision = '0016'
branch_labels = None
depends_on = None


def upgrade() -> None:
    from datapool import evals
    from datapool.sessions import rehash

    rehash(op.get_bind())
    evals.rehash(op.get_bind())


def downgrade() -> None:
    # The earlier form is not recomputed: after a downgrade, turns stored so far are continued
    # only by requests that match them without their reminders.
    pass

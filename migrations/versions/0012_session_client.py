"""sessions.client: which agent a session came from (a client profile's name, gateway.clients)

The gateway recognises known agents (Claude Code, Codex CLI, OpenClaw, ...) by their requests
and stores the profile's name on the session the request starts; the admin UI shows it as a
column and filters by it. Sessions captured before are left without one.

Revision ID: 0012
Revises: 0011
Create Date: 2026-11-28
"""

import sqlalchemy as sa
from alembic import op

revision = '0012'
down_revision = '0011'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # a plain ADD COLUMN (no table rebuild on SQLite, so no trigger is lost)
    op.add_column('sessions', sa.Column('client', sa.String(length=32), nullable=True))
    op.create_index('ix_sessions_client', 'sessions', ['client'])


def downgrade() -> None:
    op.drop_index('ix_sessions_client', table_name='sessions')
    # no batch rebuild: dropping `sessions` on SQLite would cascade into its turns
    op.execute("ALTER TABLE sessions DROP COLUMN client")

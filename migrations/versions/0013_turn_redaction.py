"""turns.redaction: what redaction replaced in a turn (counts per detector) and which of its token
positions were masked (``prompt``, ``reply``); trained with zero loss weight there

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0013'
down_revision = '0012'
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    # a plain ADD COLUMN: no rebuild of `turns` on SQLite, which would drop its triggers (0010)
    op.add_column('turns', sa.Column('redaction', JSON, nullable=True))


def downgrade() -> None:
    # SQLite (3.35+) drops a column in place too
    op.execute("ALTER TABLE turns DROP COLUMN redaction")

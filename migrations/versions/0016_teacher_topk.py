"""judgements.teacher_topk_ids and teacher_topk_logprobs: the teacher's k most likely tokens
and their logprobs per response position, so OPD can distil the top k instead of one token

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

revision = '0016'
down_revision = '0015'
branch_labels = None
depends_on = None


def _json() -> sa.types.TypeEngine:
    return sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    # plain ADD COLUMN (no batch copy of the table on SQLite: its triggers, migration 0010, stay)
    op.add_column('judgements', sa.Column('teacher_topk_ids', _json(), nullable=True))
    op.add_column('judgements', sa.Column('teacher_topk_logprobs', _json(), nullable=True))


def downgrade() -> None:
    op.execute("ALTER TABLE judgements DROP COLUMN teacher_topk_logprobs")
    op.execute("ALTER TABLE judgements DROP COLUMN teacher_topk_ids")

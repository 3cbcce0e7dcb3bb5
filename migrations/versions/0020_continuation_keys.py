"""turn_continuations.created_at, answered, system_free: each continuation row carries its turn's
time and kind, with an index, so that stitching reads the first turns of a hash of each kind as
an index range, however many stored turns share the hash (datapool.stitch_reads.first_in_pool)

Revision ID: 0020
Revises: 0019
Create Date: 2026-11-29
"""

from alembic import op
import sqlalchemy as sa

revision = '0020'
down_revision = '0019'
branch_labels = None
depends_on = None


def upgrade() -> None:
    # plain ADD COLUMN, as 0018 and 0019
    op.add_column('turn_continuations', sa.Column('created_at', sa.DateTime(timezone=True), nullable=True))
    op.add_column('turn_continuations', sa.Column('answered', sa.Boolean(), nullable=True))
    op.add_column('turn_continuations', sa.Column('system_free', sa.Boolean(), nullable=True))
    from datapool.stitch_writes import fill_continuation_keys

    fill_continuation_keys(op.get_bind())
    op.create_index('ix_turn_continuations_first', 'turn_continuations',
                    ['hash', 'system_free', 'answered', 'created_at', 'turn_id'])


def downgrade() -> None:
    op.drop_index('ix_turn_continuations_first', table_name='turn_continuations')
    for column in ('system_free', 'answered', 'created_at'):
        op.execute(f"ALTER TABLE turn_continuations DROP COLUMN {column}")

"""judgements and votes

Revision ID: 0002
Revises: 0001
Create Date: 2026-11-26
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects import postgresql

revision = '0002'
down_revision = '0001'
branch_labels = None
depends_on = None

JSON = sa.JSON(none_as_null=True).with_variant(postgresql.JSONB(none_as_null=True), 'postgresql')


def upgrade() -> None:
    op.create_table('judgements',
    sa.Column('turn_id', sa.String(length=36), nullable=False),
    sa.Column('status', sa.String(length=16), nullable=False),
    sa.Column('reward', sa.Float(), nullable=True),
    sa.Column('prm_reward', sa.Float(), nullable=True),
    sa.Column('vote_mean', sa.Float(), nullable=True),
    sa.Column('integrated_reward', sa.Float(), nullable=True),
    sa.Column('hint', sa.Text(), nullable=True),
    sa.Column('hint_source', sa.String(length=16), nullable=True),
    sa.Column('teacher_prompt_ids', JSON, nullable=True),
    sa.Column('teacher_logprobs', JSON, nullable=True),
    sa.Column('judge', sa.String(length=256), nullable=True),
    sa.Column('prompt_version', sa.String(length=64), nullable=True),
    sa.Column('attempts', sa.Integer(), nullable=False),
    sa.Column('last_error', sa.Text(), nullable=True),
    sa.Column('enqueued_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('updated_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('turn_id')
    )
    with op.batch_alter_table('judgements', schema=None) as batch_op:
        batch_op.create_index(batch_op.f('ix_judgements_enqueued_at'), ['enqueued_at'], unique=False)
        batch_op.create_index(batch_op.f('ix_judgements_status'), ['status'], unique=False)

    op.create_table('votes',
    sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
    sa.Column('turn_id', sa.String(length=36), nullable=False),
    sa.Column('kind', sa.String(length=16), nullable=False),
    sa.Column('dedupe_key', sa.String(length=512), nullable=False),
    sa.Column('judge', sa.String(length=256), nullable=False),
    sa.Column('prompt_version', sa.String(length=64), nullable=True),
    sa.Column('vote_index', sa.Integer(), nullable=False),
    sa.Column('value', sa.Integer(), nullable=True),
    sa.Column('rationale', sa.Text(), nullable=True),
    sa.Column('hint', sa.Text(), nullable=True),
    sa.Column('raw', sa.Text(), nullable=True),
    sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
    sa.ForeignKeyConstraint(['turn_id'], ['turns.id'], ondelete='CASCADE'),
    sa.PrimaryKeyConstraint('id')
    )
    with op.batch_alter_table('votes', schema=None) as batch_op:
        batch_op.create_index('uq_votes_turn_dedupe', ['turn_id', 'dedupe_key'], unique=True)

    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.add_column(sa.Column('outcome', sa.Float(), nullable=True))
        batch_op.add_column(sa.Column('outcome_source', sa.String(length=256), nullable=True))
        batch_op.add_column(sa.Column('outcome_at', sa.DateTime(timezone=True), nullable=True))

    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.add_column(sa.Column('response_id', sa.String(length=256), nullable=True))
        batch_op.create_index(batch_op.f('ix_turns_response_id'), ['response_id'], unique=False)



def downgrade() -> None:
    with op.batch_alter_table('turns', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_turns_response_id'))
        batch_op.drop_column('response_id')

    with op.batch_alter_table('sessions', schema=None) as batch_op:
        batch_op.drop_column('outcome_at')
        batch_op.drop_column('outcome_source')
        batch_op.drop_column('outcome')

    with op.batch_alter_table('votes', schema=None) as batch_op:
        batch_op.drop_index('uq_votes_turn_dedupe')

    op.drop_table('votes')
    with op.batch_alter_table('judgements', schema=None) as batch_op:
        batch_op.drop_index(batch_op.f('ix_judgements_status'))
        batch_op.drop_index(batch_op.f('ix_judgements_enqueued_at'))

    op.drop_table('judgements')

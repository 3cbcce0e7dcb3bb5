"""Forgetting: policy_versions.tainted (learned from forgotten data; never served again) and
audit_log (who did what, when)

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa
from sqlalchemy.dialects.postgresql import JSONB

revision = '0015'
down_revision = '0014'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('policy_versions', sa.Column('tainted', sa.Boolean(), server_default=sa.false(), nullable=False))
    op.create_table(
        'audit_log',
        sa.Column('id', sa.Integer(), autoincrement=True, nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('actor', sa.String(length=256), nullable=False),
        sa.Column('action', sa.String(length=32), nullable=False),
        sa.Column('target', sa.String(length=512), nullable=True),
        sa.Column('details', sa.JSON(none_as_null=True).with_variant(JSONB(none_as_null=True), 'postgresql'),
                  nullable=False),
        sa.PrimaryKeyConstraint('id'),
    )
    op.create_index('ix_audit_log_created_at', 'audit_log', ['created_at'])
    op.create_index('ix_audit_log_action', 'audit_log', ['action'])


def downgrade() -> None:
    op.drop_index('ix_audit_log_action', table_name='audit_log')
    op.drop_index('ix_audit_log_created_at', table_name='audit_log')
    op.drop_table('audit_log')
    op.execute("ALTER TABLE policy_versions DROP COLUMN tainted")

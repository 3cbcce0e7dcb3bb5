"""Tenants: sessions.tenant (the tenant of the client key that opened the session) and api_keys
(client keys issued through the admin API, by hash)

Revision ID: 0014
Revises: 0013
Create Date: 2026-11-28
"""

from alembic import op
import sqlalchemy as sa

revision = '0014'
down_revision = '0013'
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.add_column('sessions', sa.Column('tenant', sa.String(length=64), nullable=True))
    op.create_index('ix_sessions_tenant', 'sessions', ['tenant'])
    op.create_table(
        'api_keys',
        sa.Column('id', sa.String(length=36), nullable=False),
        sa.Column('tenant', sa.String(length=64), nullable=False),
        sa.Column('key_hash', sa.String(length=64), nullable=False),
        sa.Column('created_at', sa.DateTime(timezone=True), nullable=False),
        sa.Column('created_by', sa.String(length=128), nullable=False),
        sa.Column('revoked_at', sa.DateTime(timezone=True), nullable=True),
        sa.PrimaryKeyConstraint('id'),
        sa.UniqueConstraint('key_hash'),
    )
    op.create_index('ix_api_keys_tenant', 'api_keys', ['tenant'])


def downgrade() -> None:
    op.drop_index('ix_api_keys_tenant', table_name='api_keys')
    op.drop_table('api_keys')
    op.drop_index('ix_sessions_tenant', table_name='sessions')
    op.execute("ALTER TABLE sessions DROP COLUMN tenant")

"""canary: a gate-passed candidate served to a sticky fraction of users beside production

At most one canary is active (partial unique index, like production's). Rows are kept after a
canary stops: its window is what the online comparison per checkpoint reads.

Revision ID: 0015
Revises: 0014
Create Date: 2026-11-24 04:30:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0015'
down_revision: Union[str, None] = '0014'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.create_table('canary',
    sa.Column('id', sa.UUID(), nullable=False),
    sa.Column('checkpoint_id', sa.String(length=128), nullable=False),
    sa.Column('production_id', sa.String(length=128), nullable=False),
    sa.Column('fraction', sa.Float(), nullable=False, comment='share of users served by the canary, (0, 1)'),
    sa.Column('status', sa.String(length=16), nullable=False, comment='active | stopped'),
    sa.Column('actor', sa.String(length=128), nullable=False),
    sa.Column('reason', sa.Text(), nullable=False),
    sa.Column('gate_decision_id', sa.UUID(), nullable=True),
    sa.Column('started_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
    sa.Column('stopped_at', sa.DateTime(timezone=True), nullable=True),
    sa.Column('stopped_by', sa.String(length=128), nullable=True),
    sa.Column('stop_reason', sa.Text(), nullable=True),
    sa.ForeignKeyConstraint(['checkpoint_id'], ['checkpoint.id'], name=op.f('fk_canary_checkpoint_id_checkpoint')),
    sa.ForeignKeyConstraint(['production_id'], ['checkpoint.id'], name=op.f('fk_canary_production_id_checkpoint')),
    sa.PrimaryKeyConstraint('id', name=op.f('pk_canary'))
    )
    op.create_index('uq_canary_one_active', 'canary', ['status'], unique=True,
                    postgresql_where=sa.text("status = 'active'"))
    op.create_index('ix_canary_checkpoint_id', 'canary', ['checkpoint_id'], unique=False)


def downgrade() -> None:
    op.drop_index('ix_canary_checkpoint_id', table_name='canary')
    op.drop_index('uq_canary_one_active', table_name='canary')
    op.drop_table('canary')

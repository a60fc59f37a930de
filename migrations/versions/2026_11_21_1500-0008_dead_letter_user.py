"""dead_letter.user_id: the user a dead letter claims to be from, so an erasure finds it by index

An erasure used to find a user's dead letters by searching every row's raw bytes for the quoted user
id (``position(... in raw)``), a full scan and de-TOAST of ``dead_letter`` while the erasure holds
the projection lock exclusively (the whole consumer group waits). Now a dead letter whose raw bytes
are a JSON object with a string ``user_id`` records it (``consumers.deadletter.claim_of``),
and the erasure deletes ``user_id = X`` through ``ix_dead_letter_user_id`` plus, among the
unattributed rows only (``ix_dead_letter_unattributed``: not JSON, oversized, no usable user id,
or stored before this migration), those whose bytes carry the quoted id.

Revision ID: 0008
Revises: 0007
Create Date: 2026-11-21 15:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0008'
down_revision: Union[str, None] = '0007'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('dead_letter', sa.Column('user_id', sa.String(length=128), nullable=True,
                                           comment='top-level user_id of the raw JSON object, if any (erasure)'))
    op.create_index('ix_dead_letter_user_id', 'dead_letter', ['user_id'], unique=False)
    op.create_index('ix_dead_letter_unattributed', 'dead_letter', ['id'], unique=False,
                    postgresql_where=sa.text('user_id IS NULL'))


def downgrade() -> None:
    op.drop_index('ix_dead_letter_unattributed', table_name='dead_letter', postgresql_where=sa.text('user_id IS NULL'))
    op.drop_index('ix_dead_letter_user_id', table_name='dead_letter')
    op.drop_column('dead_letter', 'user_id')

"""erasure_request keyed by (user_id, request_id): a request id reused for another user is erased too

A request was treated as done by its ``request_id`` alone, so a request for user B reusing the id of
an earlier request for user A deleted nothing. The unique key is now the pair (its ``user_id``
column first, so it also serves the lookups by user the separate user index served).

Revision ID: 0013
Revises: 0012
Create Date: 2026-11-24 04:30:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0013'
down_revision: Union[str, None] = '0012'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.drop_constraint('uq_erasure_request_request_id', 'erasure_request', type_='unique')
    op.create_unique_constraint(op.f('uq_erasure_request_user_id_request_id'), 'erasure_request',
                                ['user_id', 'request_id'])
    op.drop_index('ix_erasure_request_user_id', table_name='erasure_request')


def downgrade() -> None:
    # Fails if a request id was reused for two users since the upgrade (as it should: the old key
    # cannot hold both).
    op.create_index('ix_erasure_request_user_id', 'erasure_request', ['user_id'], unique=False)
    op.drop_constraint(op.f('uq_erasure_request_user_id_request_id'), 'erasure_request', type_='unique')
    op.create_unique_constraint('uq_erasure_request_request_id', 'erasure_request', ['request_id'])

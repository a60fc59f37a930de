"""dead_letter.session_id and dead_letter.redacted: a privacy-mode session's dead letters keep no bytes

Events of a privacy-mode session are never stored, but its malformed records used to be, raw bytes
and all, in ``dead_letter``. Now:

- ``session_id``: the session a dead letter's raw JSON claims (``consumers.deadletter.claim_of``),
  so a session found to be private part-way finds its earlier dead letters by index;
- ``redacted``: why a row keeps no key, bytes or headers: ``erasure`` (the user's erasure covers
  it) or ``privacy`` (its session is in privacy mode); NULL for a row stored whole. Rows redacted
  by an erasure before this migration (no bytes, no headers) are marked ``erasure``.

Revision ID: 0010
Revises: 0009
Create Date: 2026-11-21 20:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0010'
down_revision: Union[str, None] = '0009'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('dead_letter', sa.Column('session_id', sa.String(length=128), nullable=True,
                                           comment='top-level session_id of the raw JSON object, if any (privacy)'))
    op.add_column('dead_letter', sa.Column('redacted', sa.String(length=16), nullable=True,
                                           comment='why key, bytes and headers are not kept: erasure | privacy'))
    op.create_index('ix_dead_letter_session_id', 'dead_letter', ['session_id'], unique=False)
    op.execute("UPDATE dead_letter SET redacted = 'erasure' WHERE raw IS NULL AND headers IS NULL")


def downgrade() -> None:
    op.drop_index('ix_dead_letter_session_id', table_name='dead_letter')
    op.drop_column('dead_letter', 'redacted')
    op.drop_column('dead_letter', 'session_id')

"""dead_letter.redriven_at: when a dead letter was last published back to its topic

``flywheel deadletters redrive`` publishes the raw bytes of chosen dead letters back to their source
topic (after a consumer fix, say) and records when, so a second redrive of the same selection skips
them unless asked to repeat.

Revision ID: 0009
Revises: 0008
Create Date: 2026-11-21 18:00:00
"""
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0009'
down_revision: Union[str, None] = '0008'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column('dead_letter', sa.Column('redriven_at', sa.DateTime(timezone=True), nullable=True,
                                           comment='when the raw bytes were last published back to the topic'))


def downgrade() -> None:
    op.drop_column('dead_letter', 'redriven_at')

"""the producer's span id beside its trace id in event_log

- ``event_log.span_id``: the span id of the producer's W3C ``traceparent`` header (16 lower-case
  hex digits); with ``trace_id`` it names the span that emitted the event, which a training cycle's
  span links to (``trainer.trace_links``). NULL when the record carried no well-formed
  ``traceparent`` and for rows stored before this revision.

Revision ID: 0018
Revises: 0017
Create Date: 2026-11-26 04:30:00
"""

from collections.abc import Sequence
from typing import Union

import sqlalchemy as sa
from alembic import op

revision: str = "0018"
down_revision: Union[str, None] = "0017"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column(
        "event_log",
        sa.Column(
            "span_id",
            sa.String(length=16),
            nullable=True,
            comment="the producer's span id (traceparent): with trace_id, the span that emitted the event",
        ),
    )


def downgrade() -> None:
    op.drop_column("event_log", "span_id")

"""event_log.seq is reserved in blocks of 1024

The ingest consumer assigns ``seq`` itself (it needs the values to fold events in order before the
COPY). Calling ``nextval`` once per event cost ~5 us of Postgres CPU per event (a fifth of the
``event_log`` append; bench/ingest.py). With ``INCREMENT BY 1024`` one ``nextval`` reserves the block
``[v, v + 1023]``; a batch takes ceil(n / 1024) of them. ``seq`` stays unique and increasing in
reservation order, which is all it is used for (fold order, watermarks); values are no longer dense,
and a row inserted by the column default (not the consumer) skips the rest of its block.

Revision ID: 0007
Revises: 0006
Create Date: 2026-11-21 14:00:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0007'
down_revision: Union[str, None] = '0006'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

SEQ_BLOCK = 1024


def upgrade() -> None:
    op.execute(f"ALTER SEQUENCE event_log_seq_seq INCREMENT BY {SEQ_BLOCK}")


def downgrade() -> None:
    # past the last reserved block, whose values a consumer may already hold
    op.execute(f"SELECT setval('event_log_seq_seq', last_value + {SEQ_BLOCK - 1}) FROM event_log_seq_seq")
    op.execute("ALTER SEQUENCE event_log_seq_seq INCREMENT BY 1")

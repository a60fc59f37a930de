"""event_log payload as json text; storage tuned for the ingest path

- ``event_log.payload`` becomes ``json`` (the validated payload's text, kept as is) instead of
  ``jsonb``: the log is written once per event and read whole by replay and relabel, never queried
  by key, so decomposing every payload into jsonb was pure cost (~7 us of Postgres CPU per event,
  a fifth of the ingest transaction's; bench/ingest.py). ``->``/``->>`` still work on json.
- ``toast_tuple_target = 8160`` on ``event_log`` and ``trajectory``: rows up to a page stay inline
  and uncompressed (a ``model.responded`` row is ~2.5 kB of base64 that pglz cannot shrink much).
- ``trajectory_segment.token_ids`` / ``behaviour_logprobs`` ``STORAGE EXTERNAL``: random int32 and
  float32 bytes do not compress; skip trying on every rewrite of an open segment.

Revision ID: 0006
Revises: 0005
Create Date: 2026-11-21 12:30:00
"""
from typing import Sequence, Union

from alembic import op

revision: str = '0006'
down_revision: Union[str, None] = '0005'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.execute("ALTER TABLE event_log ALTER COLUMN payload TYPE json USING payload::json")
    op.execute("ALTER TABLE event_log SET (toast_tuple_target = 8160)")
    op.execute("ALTER TABLE trajectory SET (toast_tuple_target = 8160)")
    op.execute("ALTER TABLE trajectory_segment ALTER COLUMN token_ids SET STORAGE EXTERNAL")
    op.execute("ALTER TABLE trajectory_segment ALTER COLUMN behaviour_logprobs SET STORAGE EXTERNAL")


def downgrade() -> None:
    op.execute("ALTER TABLE trajectory_segment ALTER COLUMN behaviour_logprobs SET STORAGE EXTENDED")
    op.execute("ALTER TABLE trajectory_segment ALTER COLUMN token_ids SET STORAGE EXTENDED")
    op.execute("ALTER TABLE trajectory RESET (toast_tuple_target)")
    op.execute("ALTER TABLE event_log RESET (toast_tuple_target)")
    op.execute("ALTER TABLE event_log ALTER COLUMN payload TYPE jsonb USING payload::jsonb")

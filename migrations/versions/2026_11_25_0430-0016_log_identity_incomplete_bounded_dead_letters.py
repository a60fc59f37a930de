"""log identity beside the offsets, incomplete trajectories, bounded dead letters

- ``consumer_offset.log_id``: the identity of the partition's log the stored offset counts in (the
  broker's topic id); a log re-created under the same name gets a new one, which offsets alone
  cannot show once the new log has refilled past them. NULL: not known yet (rows from before).
- ``event_log.producer_seq``: the envelope's optional ``seq`` (the event's place in its session as
  the producer emitted it), so a replay folds what the live consumer folded.
- ``trajectory.producer_seq_count`` / ``producer_seq_max``: how many events carrying the producer's
  per-session ``seq`` were folded in, and the highest; ``trajectory.incomplete_reason``: why a
  finalized trajectory's events are incomplete (no ``session.started``, missing ``seq`` values),
  NULL when they are not. The trainer never selects a trajectory that has one.
- ``dead_letter.raw_size`` / ``raw_sha256``: the record's size in bytes and its SHA-256, so a row
  whose ``raw`` keeps only the record's head (an oversized record) still says what it was. NULL for
  rows stored before (their ``raw`` is whole).

Revision ID: 0016
Revises: 0015
Create Date: 2026-11-25 04:30:00
"""

from collections.abc import Sequence
from typing import Union

import sqlalchemy as sa
from alembic import op

revision: str = "0016"
down_revision: Union[str, None] = "0015"
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None


def upgrade() -> None:
    op.add_column(
        "consumer_offset",
        sa.Column(
            "log_id",
            sa.String(length=128),
            nullable=True,
            comment="identity of the log next_offset counts in (the broker's topic id); NULL: not known yet",
        ),
    )
    op.add_column(
        "event_log",
        sa.Column(
            "producer_seq",
            sa.Integer(),
            nullable=True,
            comment="the envelope's seq: the event's place in its session as the producer emitted it",
        ),
    )
    op.add_column(
        "trajectory",
        sa.Column(
            "producer_seq_count",
            sa.Integer(),
            server_default=sa.text("0"),
            nullable=False,
            comment="events folded in that carry the producer's per-session seq",
        ),
    )
    op.add_column(
        "trajectory",
        sa.Column("producer_seq_max", sa.Integer(), nullable=True, comment="highest producer seq folded in"),
    )
    op.add_column(
        "trajectory",
        sa.Column(
            "incomplete_reason",
            sa.Text(),
            nullable=True,
            comment="why the finalized events are incomplete (never trained on); NULL: complete",
        ),
    )
    op.add_column(
        "dead_letter",
        sa.Column(
            "raw_size",
            sa.BigInteger(),
            nullable=True,
            comment="the record's size in bytes (raw may keep only its head)",
        ),
    )
    op.add_column(
        "dead_letter", sa.Column("raw_sha256", sa.LargeBinary(), nullable=True, comment="SHA-256 of the record's bytes")
    )


def downgrade() -> None:
    op.drop_column("dead_letter", "raw_sha256")
    op.drop_column("dead_letter", "raw_size")
    op.drop_column("trajectory", "incomplete_reason")
    op.drop_column("trajectory", "producer_seq_max")
    op.drop_column("trajectory", "producer_seq_count")
    op.drop_column("event_log", "producer_seq")
    op.drop_column("consumer_offset", "log_id")

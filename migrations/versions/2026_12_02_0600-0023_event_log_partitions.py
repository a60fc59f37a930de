"""event_log range-partitioned by occurred_at; the event_archive catalog

``event_log`` is rebuilt in place as a partitioned table: the old table is renamed, a partitioned
``event_log`` with the same columns (``LIKE``: types, defaults, comments, storage) is created, one
partition per UTC day that holds rows plus today and the next 3 days, and a default partition that
takes any other ``occurred_at`` so no insert is refused; the rows are copied (``seq`` values kept,
the ``seq`` sequence handed to the new table) and the old table dropped. Beat keeps partitions
created ahead from then on (``consumers.partitions``; daily or weekly by
``FLYWHEEL_EVENTS_PARTITION_PERIOD``, continuing from the last bound made here).

Postgres puts the partition key in every unique index: the primary key becomes ``(seq,
occurred_at)`` and the event id's unique key ``(event_id, occurred_at)``. A redelivered record
carries the same envelope, hence the same ``occurred_at``, so the key still refuses every
redelivery; ``app.repositories.events.append_events`` explains the window that catches an id
re-sent with another time. Partitions are created ``toast_tuple_target = 8160`` as 0006 set on the
table (a partitioned table holds no storage parameters itself). The append-only trigger is made on
the partitioned table, so every partition has it.

The copy holds an ACCESS EXCLUSIVE lock on ``event_log`` while it runs: stop the consumers first on a
large table (the ingest resumes from its stored offsets).

Revision ID: 0023
Revises: 0022
Create Date: 2026-12-02 06:00:00
"""
from datetime import timedelta
from typing import Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0023'
down_revision: Union[str, None] = '0022'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

AHEAD_DAYS = 3
TOAST = "toast_tuple_target = 8160"
TRIGGER = (
    "CREATE TRIGGER event_log_append_only BEFORE UPDATE OR DELETE ON event_log "
    "FOR EACH ROW EXECUTE FUNCTION flywheel_event_log_guard()"
)


def upgrade() -> None:
    op.execute("ALTER TABLE event_log RENAME TO event_log_unpartitioned")
    op.execute("ALTER TABLE event_log_unpartitioned RENAME CONSTRAINT pk_event_log TO pk_event_log_unpartitioned")
    op.execute(
        "ALTER TABLE event_log_unpartitioned RENAME CONSTRAINT uq_event_log_event_id TO uq_event_log_unpartitioned_event_id"
    )
    op.execute("ALTER INDEX ix_event_log_session_seq RENAME TO ix_event_log_unpartitioned_session_seq")
    op.execute("ALTER INDEX ix_event_log_user_id RENAME TO ix_event_log_unpartitioned_user_id")
    op.execute(
        "CREATE TABLE event_log (LIKE event_log_unpartitioned INCLUDING DEFAULTS INCLUDING COMMENTS "
        "INCLUDING STORAGE) PARTITION BY RANGE (occurred_at)"
    )
    op.execute("ALTER TABLE event_log ADD CONSTRAINT pk_event_log PRIMARY KEY (seq, occurred_at)")
    op.execute(
        "ALTER TABLE event_log ADD CONSTRAINT uq_event_log_event_id_occurred_at UNIQUE (event_id, occurred_at)"
    )
    op.execute("CREATE INDEX ix_event_log_session_seq ON event_log (session_id, seq)")
    op.execute("CREATE INDEX ix_event_log_user_id ON event_log (user_id)")
    op.execute(TRIGGER)
    op.execute("ALTER SEQUENCE event_log_seq_seq OWNED BY event_log.seq")
    op.execute(f"CREATE TABLE event_log_default PARTITION OF event_log DEFAULT WITH ({TOAST})")
    days = op.get_bind().execute(sa.text(
        "SELECT d::date FROM (SELECT DISTINCT date_trunc('day', occurred_at AT TIME ZONE 'UTC') AS d "
        "FROM event_log_unpartitioned UNION SELECT date_trunc('day', now() AT TIME ZONE 'UTC') "
        f"+ make_interval(days => g) FROM generate_series(0, {AHEAD_DAYS}) AS g) AS days ORDER BY 1"
    )).scalars().all()
    for day in days:
        op.execute(
            f"CREATE TABLE event_log_p{day:%Y%m%d} PARTITION OF event_log FOR VALUES "
            f"FROM ('{day:%Y-%m-%d} 00:00+00') TO ('{day + timedelta(days=1):%Y-%m-%d} 00:00+00') "
            f"WITH ({TOAST})"
        )
    op.execute("INSERT INTO event_log SELECT * FROM event_log_unpartitioned")
    op.execute("DROP TABLE event_log_unpartitioned")
    op.create_table(
        'event_archive',
        sa.Column('partition_name', sa.String(length=63), nullable=False),
        sa.Column('range_start', sa.DateTime(timezone=True), nullable=False),
        sa.Column('range_end', sa.DateTime(timezone=True), nullable=False, comment='exclusive'),
        sa.Column('url', sa.Text(), nullable=False, comment='the Parquet file (an fsspec URL)'),
        sa.Column('rows', sa.BigInteger(), nullable=False, comment='rows the file holds now'),
        sa.Column(
            'sha256', sa.String(length=64), nullable=False,
            comment="consumers.archive.rows_digest of the file's rows (hex)",
        ),
        sa.Column('archived_at', sa.DateTime(timezone=True), server_default=sa.text('now()'), nullable=False),
        sa.Column(
            'rewritten_at', sa.DateTime(timezone=True), nullable=True,
            comment="when an erasure last rewrote the file without a user's rows",
        ),
        sa.Column(
            'rows_erased', sa.BigInteger(), server_default=sa.text('0'), nullable=False,
            comment='rows erasures removed from the file',
        ),
        sa.PrimaryKeyConstraint('partition_name', name=op.f('pk_event_archive')),
    )
    op.create_index('ix_event_archive_range', 'event_archive', ['range_start', 'range_end'], unique=False)


def downgrade() -> None:
    # Archived partitions stay in their Parquet files; only what Postgres holds comes back.
    op.drop_index('ix_event_archive_range', table_name='event_archive')
    op.drop_table('event_archive')
    op.execute("ALTER TABLE event_log RENAME TO event_log_partitioned")
    op.execute("ALTER TABLE event_log_partitioned RENAME CONSTRAINT pk_event_log TO pk_event_log_partitioned")
    op.execute(
        "ALTER TABLE event_log_partitioned RENAME CONSTRAINT uq_event_log_event_id_occurred_at "
        "TO uq_event_log_partitioned_event_id_occurred_at"
    )
    op.execute("ALTER INDEX ix_event_log_session_seq RENAME TO ix_event_log_partitioned_session_seq")
    op.execute("ALTER INDEX ix_event_log_user_id RENAME TO ix_event_log_partitioned_user_id")
    op.execute(
        "CREATE TABLE event_log (LIKE event_log_partitioned INCLUDING DEFAULTS INCLUDING COMMENTS INCLUDING STORAGE) "
        f"WITH ({TOAST})"
    )
    op.execute("ALTER TABLE event_log ADD CONSTRAINT pk_event_log PRIMARY KEY (seq)")
    op.execute("ALTER TABLE event_log ADD CONSTRAINT uq_event_log_event_id UNIQUE (event_id)")
    op.execute("CREATE INDEX ix_event_log_session_seq ON event_log (session_id, seq)")
    op.execute("CREATE INDEX ix_event_log_user_id ON event_log (user_id)")
    op.execute(TRIGGER)
    op.execute("ALTER SEQUENCE event_log_seq_seq OWNED BY event_log.seq")
    # an id stored twice under two occurred_at values (possible only past the dedupe window) keeps its first row
    op.execute(
        "INSERT INTO event_log SELECT * FROM event_log_partitioned ORDER BY seq ON CONFLICT (event_id) DO NOTHING"
    )
    op.execute("DROP TABLE event_log_partitioned")

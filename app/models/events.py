"""Event store tables: the append-only ``event_log``, consumer offsets, dead letters, privacy
tombstones and the transactional outbox.

``event_log`` is append-only: a trigger refuses UPDATE; DELETE is allowed only for erasure (the
erasure path sets ``flywheel.erasure = on`` in its transaction).

``event_log`` is range-partitioned by ``occurred_at`` (migration 0023; one partition a day or a week,
``FLYWHEEL_EVENTS_PARTITION_PERIOD``, created ahead by beat; a default partition takes what falls
outside them). Postgres wants the partition key in every unique index, so the keys are ``(seq,
occurred_at)`` and ``(event_id, occurred_at)``: a redelivered record carries its envelope's
``occurred_at``, so the second key refuses every redelivery exactly (see
``app.repositories.events.append_events`` for the bounded window that finds an id re-sent with
another ``occurred_at``). Partitions past retention move to Parquet (``event_archive`` lists them).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import JSON, BigInteger, DateTime, Index, Integer, LargeBinary, String, Text, UniqueConstraint, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column


class EventLog(Base):
    """One stored event (the source of truth projections are rebuilt from)."""

    __tablename__ = "event_log"

    seq: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    event_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), nullable=False)
    type: Mapped[str] = mapped_column(String(64), nullable=False)
    schema_version: Mapped[int] = mapped_column(Integer, nullable=False)
    occurred_at: Mapped[datetime] = mapped_column(DateTime(timezone=True), primary_key=True)
    """The partition key (range partitions by day or week)."""
    session_id: Mapped[str] = mapped_column(String(128), nullable=False)
    user_id: Mapped[str] = mapped_column(String(128), nullable=False)
    org_id: Mapped[str] = mapped_column(String(128), nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSON, nullable=False)
    """The payload's JSON text, validated, byte for byte as the producer sent it
    (``producers.events.decode_event_payload``; ``json``, not ``jsonb``: written once, read whole)."""
    topic: Mapped[str | None] = mapped_column(String(255))
    partition: Mapped[int | None] = mapped_column(Integer)
    offset: Mapped[int | None] = mapped_column(BigInteger)
    trace_id: Mapped[str | None] = mapped_column(String(32))
    span_id: Mapped[str | None] = mapped_column(
        String(16), comment="the producer's span id (traceparent): with trace_id, the span that emitted the event"
    )
    producer_seq: Mapped[int | None] = mapped_column(
        Integer, comment="the envelope's seq: the event's place in its session as the producer emitted it"
    )
    ingested_at: Mapped[datetime] = created_at_column()

    __table_args__ = (
        UniqueConstraint("event_id", "occurred_at"),
        Index("ix_event_log_session_seq", "session_id", "seq"),
        Index("ix_event_log_user_id", "user_id"),
        {"postgresql_partition_by": "RANGE (occurred_at)"},
    )


class EventArchive(Base):
    """One ``event_log`` partition written to Parquet, verified, then dropped from Postgres."""

    __tablename__ = "event_archive"

    partition_name: Mapped[str] = mapped_column(String(63), primary_key=True)
    range_start: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False)
    range_end: Mapped[datetime] = mapped_column(DateTime(timezone=True), nullable=False, comment="exclusive")
    url: Mapped[str] = mapped_column(Text, nullable=False, comment="the Parquet file (an fsspec URL)")
    rows: Mapped[int] = mapped_column(BigInteger, nullable=False, comment="rows the file holds now")
    sha256: Mapped[str] = mapped_column(
        String(64), nullable=False, comment="consumers.archive.rows_digest of the file's rows (hex)"
    )
    archived_at: Mapped[datetime] = created_at_column()
    rewritten_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), comment="when an erasure last rewrote the file without a user's rows"
    )
    rows_erased: Mapped[int] = mapped_column(
        BigInteger, nullable=False, server_default=text("0"), comment="rows erasures removed from the file"
    )

    __table_args__ = (Index("ix_event_archive_range", "range_start", "range_end"),)


class ConsumerOffset(Base):
    """The next offset a consumer group will read, written in the same transaction as its effects."""

    __tablename__ = "consumer_offset"

    group_id: Mapped[str] = mapped_column(String(255), primary_key=True)
    topic: Mapped[str] = mapped_column(String(255), primary_key=True)
    partition: Mapped[int] = mapped_column(Integer, primary_key=True)
    next_offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    log_id: Mapped[str | None] = mapped_column(
        String(128), comment="identity of the log next_offset counts in (the broker's topic id); NULL: not known yet"
    )
    updated_at: Mapped[datetime] = created_at_column()


class DeadLetter(Base):
    """A message that failed to decode or validate, kept with its raw bytes and the reason."""

    __tablename__ = "dead_letter"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(255), nullable=False)
    partition: Mapped[int] = mapped_column(Integer, nullable=False)
    offset: Mapped[int] = mapped_column(BigInteger, nullable=False)
    log_id: Mapped[str | None] = mapped_column(
        String(128),
        comment="identity of the log the offset counts in (the broker's topic id, as consumer_offset.log_id); "
        "NULL: not known",
    )
    key: Mapped[bytes | None] = mapped_column(LargeBinary)
    raw: Mapped[bytes | None] = mapped_column(LargeBinary)
    raw_size: Mapped[int | None] = mapped_column(
        BigInteger, comment="the record's size in bytes (raw may keep only its head)"
    )
    raw_sha256: Mapped[bytes | None] = mapped_column(LargeBinary, comment="SHA-256 of the record's bytes")
    headers: Mapped[list[Any] | None] = mapped_column(JSONB)
    reason: Mapped[str] = mapped_column(String(64), nullable=False)
    detail: Mapped[str] = mapped_column(Text, nullable=False, default="")
    user_id: Mapped[str | None] = mapped_column(
        String(128), comment="top-level user_id of the raw JSON object, if any (erasure)"
    )
    session_id: Mapped[str | None] = mapped_column(
        String(128), comment="top-level session_id of the raw JSON object, if any (privacy)"
    )
    redacted: Mapped[str | None] = mapped_column(
        String(16), comment="why key, bytes and headers are not kept: erasure | privacy"
    )
    created_at: Mapped[datetime] = created_at_column()
    redriven_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), comment="when the raw bytes were last published back to the topic"
    )

    __table_args__ = (
        # A position is unique within one log: after a log reset the same (partition, offset) holds
        # another record. NULLS NOT DISTINCT: a redelivery of a record whose log is not known is still one.
        UniqueConstraint("topic", "partition", "offset", "log_id", postgresql_nulls_not_distinct=True),
        Index("ix_dead_letter_reason", "reason"),
        Index("ix_dead_letter_user_id", "user_id"),
        Index("ix_dead_letter_session_id", "session_id"),
        Index("ix_dead_letter_unattributed", "id", postgresql_where=text("user_id IS NULL")),
    )


class PrivacyTombstone(Base):
    """Counts the events of a privacy-mode session; nothing else of the session is stored."""

    __tablename__ = "privacy_tombstone"

    session_id: Mapped[str] = mapped_column(String(128), primary_key=True)
    events_dropped: Mapped[int] = mapped_column(BigInteger, nullable=False, default=0)
    first_seen_at: Mapped[datetime] = created_at_column()
    last_seen_at: Mapped[datetime] = created_at_column()


OUTBOX_CHANNEL = "flywheel_outbox"
"""The Postgres NOTIFY channel a transaction that wrote outbox rows signals on commit (the relay LISTENs)."""


class Outbox(Base):
    """A message to publish, written in the same transaction as the state change it announces."""

    __tablename__ = "outbox"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    topic: Mapped[str] = mapped_column(String(255), nullable=False)
    key: Mapped[str | None] = mapped_column(String(255))
    event_type: Mapped[str] = mapped_column(String(64), nullable=False)
    payload: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False)
    headers: Mapped[list[Any] | None] = mapped_column(JSONB)
    created_at: Mapped[datetime] = created_at_column()
    sent_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_outbox_unsent", "id", postgresql_where="sent_at IS NULL"),)

"""Stored consumer offsets checked against the broker's log: a log that was re-created is re-read.

Postgres holds the group's offsets (``consumer_offset``), the broker holds the log. When the log is
re-created (the local stack's broker keeps it in memory, so every ``stack up`` starts each
partition at 0 again; in production a topic deleted and re-created, or a cluster restored) the
stored next offset can lie past the partition's end: taken as it is, every record the new log gets
below it would be skipped without a word.

Invariant: every seek of the ingest consumer to a stored offset is checked by the fetch that
follows it. A position past the log's end is answered "out of range"; the client falls back to the
log's start, so the next records come below the position sought, and the consumer
(``consumers.log_ends``, after every poll) then compares the stored offset with the log's end (the
fetch's high-water mark; the broker's ``ListOffsets`` answer only if there is none: tansu's
under-reports). A stored offset past the end is reported at ERROR with the partition and both
offsets, counted (``flywheel.consumer.offset_resets``), and handled by
``FLYWHEEL_CONSUMER_OFFSET_RESET``:

- ``earliest`` (default): the stored offset is set back to the log's start (a compare-and-set, so a
  member that moved it meanwhile wins) and the partition is read from there; what is already
  stored is dropped by ``event_id`` idempotence.
- ``fail``: the consumer stops with :class:`OffsetBeyondLogEnd` (exit code 2 from the CLI), its
  stored offsets untouched.

Offsets cannot tell a re-created log that has already refilled up to or past the stored offset
from the old one. Its identity can: the broker's topic id (a topic re-created under the same name
gets a new one; tansu, memory only, gives every topic a new one when it restarts) with the cluster
id, :func:`app.core.kafka_meta.log_id_of`. It is stored beside the offsets
(``consumer_offset.log_id``) in the batch's transaction. When the member's client reports another
identity than the one stored for a partition, the partition is reported at ERROR
(:class:`LogReplaced`), counted like an offset past the log's end, and handled by the same policy: ``earliest`` points the stored offset at the new log's start
with its identity (:func:`replace_logs`) and re-reads it, ``fail`` stops the consumer.

Limits: a broker that reports no topic id (Metadata before v10) leaves only the offset check; an
offset stored without an identity (before it was recorded) takes the first one seen; a restore
that keeps the topic id but loses records is seen only by the offset check.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.core.errors import FlywheelError
from app.repositories.offsets import replace_log, rewind_offset

log = logging.getLogger(__name__)


class OffsetBeyondLogEnd(FlywheelError):
    """A stored offset lies past its partition's log end and ``offset_reset`` is ``fail``."""


@dataclass(frozen=True)
class LogRecreated:
    """A partition whose stored next offset (``stored``) lies past its log's end offset (``end``);
    ``start`` is the log's first offset. Offsets count messages."""

    topic: str
    partition: int
    stored: int
    start: int
    end: int

    def describe(self) -> str:
        """One line naming the partition and both offsets."""
        return (
            f"{self.topic}:{self.partition}: the stored next offset {self.stored} is past the log's end offset "
            f"{self.end} (log start {self.start}): the partition's log was re-created (a broker restarted with "
            f"an empty log, a topic re-created, a cluster restored)"
        )


@dataclass(frozen=True)
class LogReplaced:
    """A partition whose stored next offset (``stored``) counts in another log (``old``) than the one
    the broker reports now (``new``, starting at offset ``start``)."""

    topic: str
    partition: int
    stored: int
    old: str
    new: str
    start: int

    def describe(self) -> str:
        """One line naming the partition, the stored offset and both identities."""
        return (
            f"{self.topic}:{self.partition}: the partition's log was re-created (log identity {self.old} -> "
            f"{self.new}): the stored next offset {self.stored} counts in the old log, whatever the new one "
            f"holds (a broker restarted with an empty log, a topic re-created, a cluster restored)"
        )


def replace_logs(session: Session, group_id: str, found: Sequence[LogReplaced]) -> dict[int, int]:
    """Point each partition's stored offset at its new log's start, with the new identity, in the
    caller's transaction (``app.repositories.events.replace_log``: unless another member did).

    Returns:
        ``{partition: next offset stored now}``.
    """
    return {r.partition: replace_log(session, group_id, r.topic, r.partition, r.new, r.start) for r in found}


def rewind_to_start(session: Session, group_id: str, found: Sequence[LogRecreated]) -> dict[int, int]:
    """Set each partition's stored next offset back to its log's start, in the caller's transaction
    (``app.repositories.events.rewind_offset``: only where it still holds the offset that was judged).

    Returns:
        ``{partition: next offset stored now}`` (the log's start, or what another member stored meanwhile).
    Raises:
        psycopg.Error: database faults.
    """
    return {r.partition: rewind_offset(session, group_id, r.topic, r.partition, r.stored, r.start) for r in found}


def report(found: Sequence[LogRecreated | LogReplaced], policy: str) -> None:
    """Log each partition at ERROR, with what ``policy`` (``earliest`` | ``fail``) does about it."""
    then = (
        "re-reading it from the log's start (FLYWHEEL_CONSUMER_OFFSET_RESET=earliest; events already stored "
        "are dropped by event_id)"
        if policy == "earliest"
        else "stopping (FLYWHEEL_CONSUMER_OFFSET_RESET=fail): reset the group's offsets, or set it to earliest"
    )
    for r in found:
        log.error("%s; %s", r.describe(), then)

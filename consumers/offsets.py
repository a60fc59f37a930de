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

A re-created log already refilled up to or past the stored offset when the consumer seeks cannot be
told from the old one by offsets: its records below the stored offset are taken as consumed.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass

from sqlalchemy.orm import Session

from app.core.errors import FlywheelError
from app.repositories.events import rewind_offset

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


def rewind_to_start(session: Session, group_id: str, found: Sequence[LogRecreated]) -> dict[int, int]:
    """Set each partition's stored next offset back to its log's start, in the caller's transaction
    (``app.repositories.events.rewind_offset``: only where it still holds the offset that was judged).

    Returns:
        ``{partition: next offset stored now}`` (the log's start, or what another member stored meanwhile).
    Raises:
        psycopg.Error: database faults.
    """
    return {r.partition: rewind_offset(session, group_id, r.topic, r.partition, r.stored, r.start) for r in found}


def report(found: Sequence[LogRecreated], policy: str) -> None:
    """Log each partition at ERROR, with what ``policy`` (``earliest`` | ``fail``) does about it."""
    then = (
        "re-reading it from the log's start (FLYWHEEL_CONSUMER_OFFSET_RESET=earliest; events already stored "
        "are dropped by event_id)"
        if policy == "earliest"
        else "stopping (FLYWHEEL_CONSUMER_OFFSET_RESET=fail): reset the group's offsets, or set it to earliest"
    )
    for r in found:
        log.error("%s; %s", r.describe(), then)

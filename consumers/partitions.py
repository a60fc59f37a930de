"""``event_log``'s time partitions: which exist, and creating them ahead of the clock.

Invariant: the partitions cover one contiguous range of ``occurred_at`` with UTC-midnight bounds
(a day, or a week from Monday, by ``FLYWHEEL_EVENTS_PARTITION_PERIOD``), beat keeps it reaching
``partitions_ahead`` periods past the current one, and the default partition takes anything outside
it, so no insert is ever refused. A new partition is created only at the end of the range; rows the
default partition already holds for its range (an event stamped days ahead) are moved into it in
the same transaction, since Postgres refuses to create a partition over rows the default holds.
Partitions leave at the other end, archived (``consumers.archive``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Literal

import psycopg

from app.core.locks import AdvisoryLock

Period = Literal["day", "week"]

DEFAULT_PARTITION = "event_log_default"
PARTITION_PREFIX = "event_log_p"
STORAGE = "toast_tuple_target = 8160"
"""What migration 0006 set on the unpartitioned table (rows up to a page stay inline): each partition
holds its own storage parameters."""

_BOUND = re.compile(r"FROM \('([^']+)'\) TO \('([^']+)'\)")


@dataclass(frozen=True)
class Partition:
    """One range partition of ``event_log``: ``[start, end)`` of ``occurred_at``, UTC."""

    name: str
    start: datetime
    end: datetime


def floor_period(t: datetime, period: Period) -> datetime:
    """The start of the period (UTC day, or ISO week from Monday) that holds ``t``."""
    day = t.astimezone(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    return day - timedelta(days=day.weekday()) if period == "week" else day


def next_bound(t: datetime, period: Period) -> datetime:
    """The first period start strictly after ``t``."""
    return floor_period(t, period) + timedelta(days=7 if period == "week" else 1)


def partition_name(start: datetime) -> str:
    """``event_log_pYYYYMMDD`` for a partition starting at ``start`` (bounds are UTC midnights, so
    the date names one partition)."""
    return f"{PARTITION_PREFIX}{start.astimezone(UTC):%Y%m%d}"


def list_partitions(conn: psycopg.Connection) -> list[Partition]:
    """The range partitions attached to ``event_log``, oldest first (the default one not included)."""
    conn.execute("SET LOCAL TimeZone = 'UTC'")  # bound literals read back in UTC
    rows = conn.execute(
        "SELECT c.relname, pg_get_expr(c.relpartbound, c.oid) FROM pg_inherits i "
        "JOIN pg_class c ON c.oid = i.inhrelid WHERE i.inhparent = 'event_log'::regclass"
    ).fetchall()
    out = []
    for name, bound in rows:
        m = _BOUND.search(bound)
        if m is None:  # the DEFAULT partition
            continue
        out.append(Partition(name, _timestamp(m.group(1)), _timestamp(m.group(2))))
    return sorted(out, key=lambda p: p.start)


def _timestamp(text: str) -> datetime:
    """A bound literal as Postgres prints it in UTC (``2026-12-02 00:00:00+00``)."""
    return datetime.fromisoformat(text).astimezone(UTC)


def ensure_partitions(conn: psycopg.Connection, *, period: Period, ahead: int, now: datetime) -> list[Partition]:
    """Create the partitions missing between the end of the covered range (or the current period's
    start, if none) and the end of the ``ahead``-th period after ``now``'s, in the caller's
    transaction. Single-flight: a pass already running elsewhere makes this one return ``[]``.

    Returns:
        the partitions created, oldest first.
    Raises:
        psycopg.Error: database faults.
    """
    if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (AdvisoryLock.EVENT_PARTITIONS,)).fetchone()[0]:  # type: ignore[index]
        return []
    parts = list_partitions(conn)
    start = parts[-1].end if parts else floor_period(now, period)
    target = floor_period(now, period)
    for _ in range(ahead + 1):
        target = next_bound(target, period)
    created = []
    while start < target:
        end = next_bound(start, period)
        created.append(create_partition(conn, Partition(partition_name(start), start, end)))
        start = end
    return created


def create_partition(conn: psycopg.Connection, part: Partition) -> Partition:
    """Create ``part`` as a partition of ``event_log``, moving the default partition's rows in its
    range into it (a range no partition covers: a gap an archive pass left, or past the end).

    Raises:
        psycopg.errors.InvalidObjectDefinition: ``part`` overlaps an existing partition.
    """
    bounds = (part.start, part.end)
    held = conn.execute(
        f"SELECT count(*) FROM {DEFAULT_PARTITION} WHERE occurred_at >= %s AND occurred_at < %s", bounds
    ).fetchone()
    if held is None or held[0] == 0:
        conn.execute(
            f"CREATE TABLE {part.name} PARTITION OF event_log FOR VALUES FROM ('{part.start.isoformat()}') "
            f"TO ('{part.end.isoformat()}') WITH ({STORAGE})"
        )
        return part
    conn.execute(f"CREATE TABLE {part.name} (LIKE event_log INCLUDING DEFAULTS INCLUDING STORAGE) WITH ({STORAGE})")
    conn.execute(
        f"INSERT INTO {part.name} SELECT * FROM {DEFAULT_PARTITION} WHERE occurred_at >= %s AND occurred_at < %s",
        bounds,
    )
    conn.execute("SELECT set_config('flywheel.erasure', 'on', true)")  # the append-only trigger's one door
    conn.execute(f"DELETE FROM {DEFAULT_PARTITION} WHERE occurred_at >= %s AND occurred_at < %s", bounds)
    conn.execute("SELECT set_config('flywheel.erasure', 'off', true)")
    conn.execute(
        f"ALTER TABLE event_log ATTACH PARTITION {part.name} FOR VALUES FROM ('{part.start.isoformat()}') "
        f"TO ('{part.end.isoformat()}')"
    )
    return part

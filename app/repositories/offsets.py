"""Consumer offsets in Postgres (``consumer_offset``), per consumer group, partition and log identity.

Invariant: offsets are read ``FOR UPDATE`` and written in the caller's transaction, so a batch's
effects and the position they came from commit together (pyeventsourcing's tracking row); a log
whose identity changed (a re-created topic, a reset broker) is recorded by :func:`replace_log`,
never silently continued.
"""

from __future__ import annotations

from collections.abc import Sequence

from sqlalchemy.orm import Session

from app.repositories.events import raw_connection


def lock_offsets(session: Session, group_id: str, first: dict[tuple[str, int], int]) -> dict[tuple[str, int], int]:
    """Lock this group's offset rows for the given partitions (creating missing rows at the batch's
    first offset) and return the stored next offsets. A concurrent consumer of the same partition
    (a zombie after a rebalance) waits here, so the later one sees what the earlier committed."""
    if not first:
        return {}
    conn = raw_connection(session)
    keys = sorted(first)
    with conn.cursor() as cur:
        cur.execute(
            "INSERT INTO consumer_offset (group_id, topic, partition, next_offset) "
            "SELECT %s, t, p, o FROM unnest(%s::text[], %s::int[], %s::bigint[]) AS u(t, p, o) "
            "ON CONFLICT DO NOTHING",
            (group_id, [k[0] for k in keys], [k[1] for k in keys], [first[k] for k in keys]),
        )
        cur.execute(
            "SELECT topic, partition, next_offset FROM consumer_offset WHERE group_id = %s "
            "AND (topic, partition) IN (SELECT * FROM unnest(%s::text[], %s::int[])) "
            "ORDER BY topic, partition FOR UPDATE",
            (group_id, [k[0] for k in keys], [k[1] for k in keys]),
        )
        return {(t, p): o for t, p, o in cur.fetchall()}


def offset_log_ids(session: Session, group_id: str, keys: Sequence[tuple[str, int]]) -> dict[tuple[str, int], str]:
    """The log identities stored with this group's offsets of ``keys`` (``(topic, partition)``),
    where one is stored (call after :func:`lock_offsets`, which holds the rows)."""
    if not keys:
        return {}
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT topic, partition, log_id FROM consumer_offset WHERE group_id = %s AND log_id IS NOT NULL "
            "AND (topic, partition) IN (SELECT * FROM unnest(%s::text[], %s::int[]))",
            (group_id, [k[0] for k in keys], [k[1] for k in keys]),
        )
        return {(t, p): i for t, p, i in cur.fetchall()}


def store_offsets(
    session: Session,
    group_id: str,
    next_offsets: dict[tuple[str, int], int],
    log_ids: dict[tuple[str, int], str] | None = None,
) -> None:
    """Advance this group's next offsets (never backwards), with the identity of the log they count
    in where ``log_ids`` gives one (else the stored one stays)."""
    if not next_offsets:
        return
    keys = sorted(next_offsets)
    ids = log_ids or {}
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "INSERT INTO consumer_offset (group_id, topic, partition, next_offset, log_id) "
            "SELECT %s, t, p, o, i FROM unnest(%s::text[], %s::int[], %s::bigint[], %s::text[]) AS u(t, p, o, i) "
            "ON CONFLICT (group_id, topic, partition) DO UPDATE SET "
            "next_offset = GREATEST(consumer_offset.next_offset, EXCLUDED.next_offset), "
            "log_id = coalesce(EXCLUDED.log_id, consumer_offset.log_id), updated_at = now()",
            (
                group_id,
                [k[0] for k in keys],
                [k[1] for k in keys],
                [next_offsets[k] for k in keys],
                [ids.get(k) for k in keys],
            ),
        )


def rewind_offset(session: Session, group_id: str, topic: str, partition: int, expected: int, to: int) -> int:
    """Set this group's next offset of one partition back to ``to``, if it still is ``expected``
    (another member may have moved it since it was read), and return the next offset stored now.
    The one write that moves an offset backwards: for a partition whose log was re-created
    (``consumers.offsets``)."""
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "UPDATE consumer_offset SET next_offset = %s, updated_at = now() WHERE group_id = %s AND topic = %s "
            "AND partition = %s AND next_offset = %s",
            (to, group_id, topic, partition, expected),
        )
        cur.execute(
            "SELECT next_offset FROM consumer_offset WHERE group_id = %s AND topic = %s AND partition = %s",
            (group_id, topic, partition),
        )
        row = cur.fetchone()
        return row[0] if row else to


def replace_log(session: Session, group_id: str, topic: str, partition: int, log_id: str, start: int) -> int:
    """Point this group's offset of one partition at the start of a new log: next offset ``start``
    and identity ``log_id``, unless it already counts in that log (another member got there first).
    The offset it held counted in another log and means nothing in this one (``consumers.offsets``).

    Returns:
        the next offset stored now.
    """
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "UPDATE consumer_offset SET next_offset = %s, log_id = %s, updated_at = now() WHERE group_id = %s "
            "AND topic = %s AND partition = %s AND log_id IS DISTINCT FROM %s",
            (start, log_id, group_id, topic, partition, log_id),
        )
        cur.execute(
            "SELECT next_offset FROM consumer_offset WHERE group_id = %s AND topic = %s AND partition = %s",
            (group_id, topic, partition),
        )
        row = cur.fetchone()
        return row[0] if row else start


def stored_positions(session: Session, group_id: str, topic: str) -> dict[int, tuple[int, str | None]]:
    """``{partition: (next_offset, log_id)}`` stored for a group and topic."""
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT partition, next_offset, log_id FROM consumer_offset WHERE group_id = %s AND topic = %s",
            (group_id, topic),
        )
        return {p: (o, i) for p, o, i in cur.fetchall()}


def stored_offsets(session: Session, group_id: str, topic: str) -> dict[int, int]:
    """``{partition: next_offset}`` stored for a group and topic."""
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT partition, next_offset FROM consumer_offset WHERE group_id = %s AND topic = %s", (group_id, topic)
        )
        return dict(cur.fetchall())

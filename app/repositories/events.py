"""Event store writes and reads: batched ``event_log`` appends, dead letters, privacy tombstones
(flush-free: they run on the session's connection and never commit). Consumer offsets are in
:mod:`app.repositories.offsets`.

Invariant: ``event_log`` rows are only ever inserted with ``ON CONFLICT (event_id, occurred_at) DO
NOTHING`` or after a lookup of the ids, so a redelivered event (same envelope, same time) is a no-op
in any partition and :func:`append_events` reports which ids were new; the caller folds only those.
An id re-sent with another ``occurred_at`` within ``FLYWHEEL_EVENTS_DEDUPE_WINDOW_S`` is found by
the lookup (a duplicate or a conflict); farther apart it is a second row (``app.models.events``).

Size: over 400 lines because every statement on the event store's tables is here, beside the row types.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Literal, NamedTuple

import psycopg
from psycopg.types.json import Jsonb
from sqlalchemy.orm import Session

from app.repositories.binary import UuidArray, with_binary_dumpers

EVENT_COLUMNS = (
    "event_id",
    "type",
    "schema_version",
    "occurred_at",
    "session_id",
    "user_id",
    "org_id",
    "payload",
    "topic",
    "partition",
    "offset",
    "trace_id",
    "producer_seq",
    "span_id",
)


def raw_connection(session: Session) -> psycopg.Connection:
    """The psycopg connection under ``session``'s current transaction (for COPY and arrays), able to
    bind :class:`~app.repositories.binary.UuidArray` parameters whenever it was opened."""
    return with_binary_dumpers(session.connection().connection.driver_connection)  # type: ignore[arg-type]


def fetch_value(conn: psycopg.Connection, query: str, params: Sequence[Any] = ()) -> Any:
    """The first value of the row ``query`` returns (a query that always returns one: ``now()``,
    ``count(*)``, ``current_schema()``).

    Raises:
        LookupError: it returned no row.
    """
    row = conn.execute(query, params).fetchone()
    if row is None:
        raise LookupError(f"no row from {query!r}")
    return row[0]


class EventRow(NamedTuple):
    """One ``event_log`` row to insert, fields in :data:`EVENT_COLUMNS` order; ``payload`` is JSON
    text. (A tuple: one is built per consumed record.)"""

    event_id: uuid.UUID
    type: str
    schema_version: int
    occurred_at: datetime
    session_id: str
    user_id: str
    org_id: str
    payload: str
    topic: str | None
    partition: int | None
    offset: int | None
    trace_id: str | None
    producer_seq: int | None = None
    """the envelope's ``seq`` (the event's place in its session as the producer emitted it), if sent"""
    span_id: str | None = None
    """the span id of the producer's ``traceparent`` header (16 hex digits), if it sent one"""


_TEMP_DDL = """CREATE TEMP TABLE IF NOT EXISTS _event_batch (
    ord int, event_id uuid, type text, schema_version int, occurred_at timestamptz, session_id text,
    user_id text, org_id text, payload json, topic text, partition int, "offset" bigint, trace_id text, producer_seq int,
    span_id text
) ON COMMIT DELETE ROWS"""
_COLS = ", ".join(f'"{c}"' for c in EVENT_COLUMNS)


_CONFLICT_KEY, DEFAULT_DEDUPE_WINDOW = "(event_id, occurred_at)", timedelta(hours=1)  # the setting's default


def append_events(
    session: Session,
    rows: Sequence[EventRow],
    method: Literal["copy", "copy_upsert", "unnest"] = "copy",
    dedupe_window: timedelta = DEFAULT_DEDUPE_WINDOW,
) -> dict[uuid.UUID, int]:
    """Append rows to ``event_log``; rows whose ``event_id`` is already stored (or repeated in
    ``rows``) are skipped. ``ingested_at`` is the transaction's ``now()``; ``seq`` follows ``rows``.

    Methods (``bench/ingest.py`` measures them): ``copy`` looks up which ids exist, reserves ``seq``
    values and COPYs the new rows straight into ``event_log`` (fastest; a concurrent insert of the
    same id between lookup and COPY fails the transaction with a unique violation, and the
    consumer's per-record fallback then uses ``copy_upsert``); ``copy_upsert`` COPYs into a temp
    table then ``INSERT .. SELECT .. ON CONFLICT (event_id, occurred_at) DO NOTHING``; ``unnest`` does
    the same from array parameters in one statement. Only ``copy`` applies ``dedupe_window``.

    Returns:
        ``{event_id: seq}`` of the rows actually inserted.
    Raises:
        psycopg.Error: database faults (the caller retries the whole transaction).
    """
    if not rows:
        return {}
    conn = raw_connection(session)
    with conn.cursor() as cur:
        if method == "copy":
            return _append_direct(cur, rows, dedupe_window)
        if method == "copy_upsert":
            cur.execute(_TEMP_DDL)
            with cur.copy(f"COPY _event_batch (ord, {_COLS}) FROM STDIN") as copy:
                for i, r in enumerate(rows):
                    copy.write_row((i, *_values(r)))
            cur.execute(
                f"INSERT INTO event_log ({_COLS}) SELECT {_COLS} FROM _event_batch ORDER BY ord "
                f"ON CONFLICT {_CONFLICT_KEY} DO NOTHING RETURNING event_id, seq"
            )
            inserted: dict[uuid.UUID, int] = dict(cur.fetchall())
            cur.execute("TRUNCATE _event_batch")  # ON COMMIT DELETE ROWS only helps after commit
            return inserted
        cols = list(zip(*[_values(r) for r in rows]))
        cur.execute(
            f"INSERT INTO event_log ({_COLS}) SELECT {_COLS} FROM unnest("
            "%s::uuid[], %s::text[], %s::int[], %s::timestamptz[], %s::text[], %s::text[], %s::text[], "
            "%s::text[]::json[], %s::text[], %s::int[], %s::bigint[], %s::text[], %s::int[], %s::text[]) WITH ORDINALITY "
            f"AS b({_COLS}, ord) ORDER BY ord ON CONFLICT {_CONFLICT_KEY} DO NOTHING RETURNING event_id, seq",
            [list(c) for c in cols],
        )
        return dict(cur.fetchall())


def _values(r: EventRow) -> tuple[Any, ...]:
    return r  # EventRow's fields are EVENT_COLUMNS, in order


_BINARY_TYPES = [
    "int8",
    "uuid",
    "text",
    "int4",
    "timestamptz",
    "text",
    "text",
    "text",
    "text",
    "text",
    "int4",
    "int8",
    "text",
    "int4",
    "text",
]


def _reserve_seqs(cur: psycopg.Cursor, n: int) -> list[int]:
    """``n`` increasing, unused ``seq`` values in one round trip. ``event_log.seq``'s sequence
    increments by 1024 (migration 0007), so one ``nextval`` reserves the block ``[v, v + 1023]``;
    this takes ceil(n / increment) of them (read from the sequence: 1 before that migration)."""
    cur.execute(
        "SELECT s.seqincrement, nextval(s.seqrelid) FROM pg_sequence s CROSS JOIN LATERAL "
        "generate_series(1, (%s + s.seqincrement - 1) / s.seqincrement) "
        "WHERE s.seqrelid = pg_get_serial_sequence('event_log', 'seq')::regclass",
        (n,),
    )
    blocks = sorted(cur.fetchall())
    return [v for block, start in blocks for v in range(start, start + block)][:n]


def _append_direct(cur: psycopg.Cursor, rows: Sequence[EventRow], window: timedelta) -> dict[uuid.UUID, int]:
    times = [r.occurred_at for r in rows]  # bounds: the planner reads only the partitions they span
    cur.execute(
        "SELECT event_id FROM event_log WHERE event_id = ANY(%b) AND occurred_at BETWEEN %s AND %s",
        (UuidArray.of([r.event_id for r in rows]), min(times) - window, max(times) + window),
    )
    seen = {r[0].int for r in cur.fetchall()}  # int keys: uuid.UUID hashes in Python, ints in C
    new: list[EventRow] = []
    for r in rows:
        key = r.event_id.int
        if key not in seen:
            seen.add(key)
            new.append(r)
    if not new:
        return {}
    seqs = _reserve_seqs(cur, len(new))
    # Binary COPY halves the client's work; the payload is already JSON text, which is json's
    # binary format too.
    with cur.copy(f"COPY event_log (seq, {_COLS}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(_BINARY_TYPES)
        for seq, r in zip(seqs, new):
            copy.write_row((seq, *r))
    return {r.event_id: seq for seq, r in zip(seqs, new)}


BODY_COLUMNS = ("type", "schema_version", "occurred_at", "session_id", "user_id", "org_id", "payload")
"""The columns that make an event what it is (not where it was read from): two records with one
``event_id`` and equal values here are the same event."""


def body_of(row: EventRow) -> tuple[Any, ...]:
    """``row``'s values of :data:`BODY_COLUMNS`, in order (``payload`` as JSON text)."""
    return (row.type, row.schema_version, row.occurred_at, row.session_id, row.user_id, row.org_id, row.payload)


def stored_bodies(session: Session, event_ids: Sequence[uuid.UUID]) -> dict[int, tuple[Any, ...]]:
    """``{event_id.int: values of BODY_COLUMNS}`` of the stored events among ``event_ids``
    (``payload`` as the JSON text stored, which is the text appended)."""
    if not event_ids:
        return {}
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT event_id, type, schema_version, occurred_at, session_id, user_id, org_id, payload::text "
            "FROM event_log WHERE event_id = ANY(%b)",
            (UuidArray.of(list(event_ids)),),
        )
        return {r[0].int: tuple(r[1:]) for r in cur.fetchall()}


def producer_spans(session: Session, event_ids: Sequence[uuid.UUID]) -> dict[uuid.UUID, tuple[str, str]]:
    """``{event_id: (trace id, span id)}`` of the producer span that emitted each stored event of
    ``event_ids`` (32 and 16 hex digits, from its ``traceparent`` header); events without one, and
    erased events, are absent."""
    if not event_ids:
        return {}
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT event_id, trace_id, span_id FROM event_log "
            "WHERE event_id = ANY(%b) AND trace_id IS NOT NULL AND span_id IS NOT NULL",
            (UuidArray.of(list(event_ids)),),
        )
        return {r[0]: (r[1], r[2]) for r in cur.fetchall()}


@dataclass(frozen=True)
class DeadLetterRow:
    """A message that cannot be stored as an event, with the reason (see ``consumers.classify``)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    raw: bytes | None
    headers: list[list[str]] | None
    reason: str
    detail: str
    user_id: str | None = None
    """The top-level ``user_id`` the raw JSON object carries, if any (what an erasure looks up)."""
    session_id: str | None = None
    """The top-level ``session_id`` the raw JSON object carries, if any (what a privacy purge looks up)."""
    redacted: str | None = None
    """Why ``key``, ``raw`` and ``headers`` are not kept: ``erasure`` or ``privacy``; None if they are."""
    raw_size: int | None = None
    """The record's size in bytes (``raw`` may hold only its head: an oversized record)."""
    raw_sha256: bytes | None = None
    """SHA-256 of the record's bytes."""
    log_id: str | None = None
    """Identity of the log ``offset`` counts in (``consumers.classify.Message.log_id``); None: not known."""


DeadLetterPosition = tuple[str, int, int, str | None]
"""``(topic, partition, offset, log_id)``: where a dead letter was read, in which log."""


def insert_dead_letters(session: Session, rows: Sequence[DeadLetterRow]) -> int:
    """Insert dead letters; a redelivered one (same topic, partition, offset and log) is skipped.

    Returns:
        The rows actually inserted (skipped redeliveries not counted; psycopg's ``rowcount`` of an
        ``executemany`` is the sum over its statements).
    """
    if not rows:
        return 0
    with raw_connection(session).cursor() as cur:
        cur.executemany(
            'INSERT INTO dead_letter (topic, partition, "offset", log_id, key, raw, headers, reason, detail, user_id, '
            "session_id, redacted, raw_size, raw_sha256) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) ON CONFLICT DO NOTHING",
            [
                (
                    r.topic,
                    r.partition,
                    r.offset,
                    r.log_id,
                    r.key,
                    r.raw,
                    Jsonb(r.headers) if r.headers is not None else None,
                    r.reason,
                    r.detail,
                    r.user_id,
                    r.session_id,
                    r.redacted,
                    r.raw_size,
                    r.raw_sha256,
                )
                for r in rows
            ],
        )
        return max(cur.rowcount, 0)


def stored_dead_letters(session: Session, positions: Sequence[DeadLetterPosition]) -> list[DeadLetterRow]:
    """The ``dead_letter`` rows at ``positions`` (topic, partition, offset, log) as this transaction
    sees them (an erasure may have deleted some, or they may be stored without their bytes), in
    partition and offset order; a row of another log at the same position is not one of them."""
    if not positions:
        return []
    topics, partitions, offsets, logs = (list(c) for c in zip(*positions))
    with raw_connection(session).cursor() as cur:
        cur.execute(
            'SELECT d.topic, d.partition, d."offset", d.key, d.raw, d.headers, d.reason, d.detail, d.user_id, '
            "d.session_id, d.redacted, d.raw_size, d.raw_sha256, d.log_id "
            "FROM dead_letter d JOIN unnest(%s::text[], %s::int[], %s::bigint[], %s::text[]) AS p(t, n, o, l) "
            'ON d.topic = p.t AND d.partition = p.n AND d."offset" = p.o AND d.log_id IS NOT DISTINCT FROM p.l '
            'ORDER BY d.topic, d.partition, d."offset"',
            (topics, partitions, offsets, logs),
        )
        return [
            DeadLetterRow(
                topic=t,
                partition=n,
                offset=o,
                key=bytes(k) if k is not None else None,
                raw=bytes(r) if r is not None else None,
                headers=h,
                reason=reason,
                detail=detail,
                user_id=u,
                session_id=sid,
                redacted=why,
                raw_size=size,
                raw_sha256=bytes(digest) if digest is not None else None,
                log_id=log,
            )
            for t, n, o, k, r, h, reason, detail, u, sid, why, size, digest, log in cur.fetchall()
        ]


def private_sessions(session: Session, session_ids: Sequence[str]) -> set[str]:
    """Which of ``session_ids`` are privacy-mode sessions (have a tombstone)."""
    if not session_ids:
        return set()
    with raw_connection(session).cursor() as cur:
        cur.execute("SELECT session_id FROM privacy_tombstone WHERE session_id = ANY(%s)", (list(session_ids),))
        return {r[0] for r in cur.fetchall()}


def count_tombstones(session: Session, dropped: dict[str, int]) -> None:
    """Add ``dropped[session_id]`` to each privacy-mode session's tombstone count."""
    if not dropped:
        return
    keys = sorted(dropped)
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "INSERT INTO privacy_tombstone (session_id, events_dropped) "
            "SELECT s, n FROM unnest(%s::text[], %s::bigint[]) AS u(s, n) "
            "ON CONFLICT (session_id) DO UPDATE SET events_dropped = privacy_tombstone.events_dropped "
            "+ EXCLUDED.events_dropped, last_seen_at = now()",
            (keys, [dropped[k] for k in keys]),
        )


def erased_users(session: Session, user_ids: Sequence[str]) -> dict[str, tuple[datetime, set[uuid.UUID]]]:
    """``{user_id: (latest requested_at, erased trajectory ids)}`` for users of ``user_ids`` with a
    processed erasure request."""
    if not user_ids:
        return {}
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT user_id, coalesce(requested_at, created_at), trajectory_ids FROM erasure_request "
            "WHERE user_id = ANY(%s)",
            (list(user_ids),),
        )
        out: dict[str, tuple[datetime, set[uuid.UUID]]] = {}
        for user, at, tids in cur.fetchall():
            prev_at, prev_ids = out.get(user, (at, set()))
            out[user] = (max(prev_at, at), prev_ids | set(tids))
        return out


def iter_event_rows(
    conn: psycopg.Connection, *, where: str = "TRUE", params: Sequence[Any] = (), order: str = "seq", chunk: int = 5000
) -> Iterator[list[tuple[Any, ...]]]:
    """Stream ``event_log`` rows (``seq, ingested_at`` + :data:`EVENT_COLUMNS`) in chunks through a
    server-side cursor. ``where``/``order`` are trusted SQL fragments written by callers in this repo."""
    with conn.cursor(name=f"events_{uuid.uuid4().hex[:8]}") as cur:
        cur.itersize = chunk
        cur.execute(f"SELECT seq, ingested_at, {_COLS} FROM event_log WHERE {where} ORDER BY {order}", params)
        while True:
            rows = cur.fetchmany(chunk)
            if not rows:
                return
            yield rows

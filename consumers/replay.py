"""Replay: rebuild the trajectory projections from ``event_log`` alone (no Kafka; archived days are
read from their Parquet files as if stored: ``consumers.archive.iter_stored_rows``).

Invariant: replaying with the settings the live consumer ran with gives the same rows the live
consumer wrote (every column of ``trajectory``, ``trajectory_segment`` and ``reward_label``),
because both paths run the same fold (``consumers.batch.project_events``) over the same events in
``seq`` order with the same ingestion clock (``event_log.ingested_at``), then the same window sweep.

Two modes: into a fresh shadow schema (``--schema``; the live tables are untouched, and
``compare_projections`` diffs the two; :func:`verify` does both as of one snapshot, beside a running
consumer group), or in place (truncate and rebuild in ONE transaction that
holds the projection lock exclusively, so ingest batches wait and readers never see a half-built
projection).
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Collection, Iterable
from dataclasses import dataclass, field
from typing import Any

import psycopg
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.errors import ConflictError, NotFoundError
from app.core.locks import AdvisoryLock
from app.repositories.events import EVENT_COLUMNS, fetch_value, raw_connection
from consumers.archive import iter_stored_rows
from consumers.batch import project_events
from consumers.finalize import finalize_due_once
from consumers.projection import Projector, StoredEvent
from producers.events import validate_event

PROJECTION_TABLES = ("trajectory", "trajectory_segment", "reward_label")
_SCHEMA_NAME = re.compile(r"[a-z_][a-z0-9_]{0,62}")


def is_schema_name(name: str) -> bool:
    """Whether ``name`` is a schema name replay creates: lower-case letters, digits and ``_``, not
    starting with a digit, at most 63 characters (Postgres's identifier limit), so it needs no quoting."""
    return _SCHEMA_NAME.fullmatch(name) is not None


def stored_event_from_row(row: tuple[Any, ...]) -> StoredEvent:
    """A :class:`StoredEvent` from an ``iter_event_rows`` row (``seq, ingested_at, *EVENT_COLUMNS``).

    Raises:
        InvalidEventError: the stored payload no longer validates (a contract change without a
            schema-version bump).
    """
    seq, ingested_at, *rest = row
    data: dict[str, Any] = dict(zip(EVENT_COLUMNS, rest))
    event = validate_event(
        {
            "event_id": data["event_id"],
            "type": data["type"],
            "schema_version": data["schema_version"],
            "occurred_at": data["occurred_at"],
            "session_id": data["session_id"],
            "user_id": data["user_id"],
            "org_id": data["org_id"],
            "payload": data["payload"],
            **({"seq": data["producer_seq"]} if data["producer_seq"] is not None else {}),
        }
    )
    return StoredEvent(event, seq, ingested_at, data["topic"], data["partition"], data["offset"])


def _check_ident(name: str) -> str:
    if not is_schema_name(name):
        raise ValueError(f"invalid schema name {name!r}")
    return name


def create_shadow_schema(session: Session, schema: str) -> str:
    """Create ``schema`` with empty copies (columns, defaults, indexes) of the projection tables.
    Returns the live schema they were copied from (the current one)."""
    _check_ident(schema)
    conn = raw_connection(session)
    home: str = fetch_value(conn, "SELECT current_schema()")
    conn.execute(f'CREATE SCHEMA "{schema}"')
    for t in PROJECTION_TABLES:
        conn.execute(f'CREATE TABLE "{schema}".{t} (LIKE "{home}".{t} INCLUDING ALL)')
    return home


def _enter_shadow_schema(session: Session, schema: str) -> str:
    """:func:`create_shadow_schema`, then resolve table names there first for the rest of the
    transaction (the projection tables are the shadow's; every other table is the live one).
    Returns the live schema."""
    home = create_shadow_schema(session, schema)
    raw_connection(session).execute(f'SET LOCAL search_path = "{schema}", ' + home)
    return home


def drop_schema(session: Session, schema: str) -> None:
    """Drop a shadow schema and its tables."""
    raw_connection(session).execute(f'DROP SCHEMA IF EXISTS "{_check_ident(schema)}" CASCADE')


def drop_shadow_schema(session: Session, schema: str) -> None:
    """Drop ``schema`` if it holds exactly the projection tables a replay creates (nothing else: not the
    live schema, not one that gained other tables).

    Raises:
        NotFoundError: the schema does not exist.
        ConflictError: it holds other tables than a replay's, or it is the live schema.
    """
    conn = raw_connection(session)
    if conn.execute("SELECT 1 FROM pg_namespace WHERE nspname = %s", (_check_ident(schema),)).fetchone() is None:
        raise NotFoundError(f"schema {schema!r} does not exist")
    tables = {
        r[0]
        for r in conn.execute(
            "SELECT c.relname FROM pg_class c JOIN pg_namespace n ON n.oid = c.relnamespace "
            "WHERE n.nspname = %s AND c.relkind IN ('r', 'p', 'v', 'm', 'f')",
            (schema,),
        )
    }
    if tables != set(PROJECTION_TABLES) or schema == fetch_value(conn, "SELECT current_schema()"):
        raise ConflictError(
            f"schema {schema!r} is not a replay's shadow schema (it holds {len(tables)} tables, "
            f"not just {', '.join(PROJECTION_TABLES)}); left alone"
        )
    drop_schema(session, schema)


@dataclass
class ReplayReport:
    """What a replay rebuilt."""

    events: int = 0
    trajectories: int = 0
    finalized_by_window: int = 0
    schema: str | None = None
    skipped_invalid: list[int] = field(default_factory=list)
    labels_not_rebuilt: dict[str, int] = field(default_factory=dict)
    """In place only: labels the live table held under specs the projection does not label (a
    ``flywheel relabel`` with an inactive spec wrote them), by spec; gone with the old rows. Run the
    relabel again to restore them."""


def rebuild(
    session: Session, projector: Projector, *, grace_s: float, chunk: int = 5000, report: ReplayReport | None = None
) -> ReplayReport:
    """Fold every ``event_log`` row, by ``seq``, into the (empty) projection tables the session's
    ``search_path`` resolves, then run the window sweep. Runs in the caller's transaction."""
    report = report or ReplayReport()
    conn = raw_connection(session)
    for rows in iter_stored_rows(conn, chunk=chunk):  # archived days too
        events = []
        for r in rows:
            try:
                events.append(stored_event_from_row(r))
            except ValueError:  # stored before a contract change: keep going, report it
                report.skipped_invalid.append(r[0])
        report.events += len(rows)
        project_events(session, projector, events)
    while True:
        done = finalize_due_once(session, projector, grace_s)
        report.finalized_by_window += sum(done.values())
        if not done:
            break
    report.trajectories = fetch_value(conn, "SELECT count(*) FROM trajectory")
    return report


def replay(projector: Projector, *, grace_s: float, schema: str | None = None, chunk: int = 5000) -> ReplayReport:
    """Rebuild the projections: into a new shadow ``schema`` if given, else in place.

    Raises:
        psycopg.errors.DuplicateSchema: the shadow schema already exists.
    """
    report = ReplayReport(schema=schema)
    with session_scope() as session:
        conn = raw_connection(session)
        if schema is not None:
            _enter_shadow_schema(session, schema)
        else:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (AdvisoryLock.PROJECTION,))
            before: dict[str, int] = dict(
                conn.execute("SELECT spec, count(*) FROM reward_label GROUP BY spec").fetchall()
            )
            conn.execute("TRUNCATE " + ", ".join(PROJECTION_TABLES))
        rebuild(session, projector, grace_s=grace_s, chunk=chunk, report=report)
        if schema is None:
            rebuilt = {r[0] for r in conn.execute("SELECT DISTINCT spec FROM reward_label").fetchall()}
            report.labels_not_rebuilt = {spec: n for spec, n in sorted(before.items()) if spec not in rebuilt}
    return report


@dataclass
class VerifyReport:
    """What :func:`verify` found."""

    replay: ReplayReport
    differences: list[str]
    """Human-readable differences (at most ``limit``); empty when the rebuilt rows equal the live ones."""
    due_unswept: int = 0
    """Live trajectories still provisional whose window closed more than the grace period before the
    snapshot: the live sweep had not reached them yet, the replay's sweep finalizes them. Left out of
    the comparison (they are not differences; ``flywheel finalize`` closes them)."""


def verify(projector: Projector, *, grace_s: float, chunk: int = 5000, limit: int = 5) -> VerifyReport:
    """Rebuild into a scratch schema and compare it row for row with the live projection tables, both
    as of ONE snapshot (a ``REPEATABLE READ`` transaction), so consumers may keep ingesting: a batch
    commits its events and its projection rows together, and one committed after the snapshot is in
    neither side. The scratch schema is dropped before the transaction ends. Takes no lock a batch
    waits on. The comparison runs in Postgres (:func:`diff_projection_schemas`): memory does not
    grow with the store.

    Raises:
        psycopg.Error: database faults.
    """
    schema = f"replay_verify_{uuid.uuid4().hex[:8]}"
    report = ReplayReport(schema=schema)
    with session_scope() as session:
        session.connection(execution_options={"isolation_level": "REPEATABLE READ"})
        conn = raw_connection(session)
        unswept = [
            r[0]
            for r in conn.execute(
                "SELECT id FROM trajectory WHERE status = 'provisional' AND window_closes_at < now() - "
                "make_interval(secs => %s)",
                (grace_s,),
            ).fetchall()
        ]
        live = _enter_shadow_schema(session, schema)
        rebuild(session, projector, grace_s=grace_s, chunk=chunk, report=report)
        differences = diff_projection_schemas(
            session, live, schema, limit=limit, skip_trajectories=unswept, names=("live tables", "replay")
        )
        drop_schema(session, schema)
    return VerifyReport(report, differences, len(unswept))


_ORDER = {
    "trajectory": ("id",),
    "trajectory_segment": ("trajectory_id", "segment_index"),
    "reward_label": ("trajectory_id", "spec"),
}
"""Each projection table's key: rows are dumped in its order and matched by it."""


def _columns(conn: psycopg.Connection, schema: str, table: str) -> list[str]:
    """``table``'s column names in ``schema``, in table order."""
    return [
        r[0]
        for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
            "ORDER BY ordinal_position",
            (schema, table),
        ).fetchall()
    ]


def _only_in(table: str, n: int, side: str, key_values: Iterable[Any]) -> str:
    """The difference line for ``n`` keys that only ``side`` has (``key_values``: the first one's)."""
    return f"{table}: {n} row(s) only in the {side}, e.g. " + ", ".join(
        f"{c}={v}" for c, v in zip(_ORDER[table], key_values)
    )


def _columns_differ(table: str, key_values: Iterable[Any], columns: Iterable[str]) -> str:
    """The difference line for a key both sides have whose ``columns`` differ."""
    return (
        f"{table} "
        + ", ".join(f"{c}={v}" for c, v in zip(_ORDER[table], key_values))
        + f": {', '.join(columns)} differ"
    )


class Rows(list[tuple[Any, ...]]):
    """A table's rows as tuples (a list), with ``columns``: the names of the tuples' fields."""

    def __init__(self, rows: Iterable[tuple[Any, ...]] = (), columns: tuple[str, ...] = ()) -> None:
        super().__init__(rows)
        self.columns = columns


def dump_projection(
    session: Session, schema: str | None = None, exclude: dict[str, set[str]] | None = None
) -> dict[str, Rows]:
    """Every row of the projection tables of ``schema`` (default: the current one), as tuples in key
    order, leaving out ``exclude[table]`` columns (never a key column)."""
    conn = raw_connection(session)
    schema = schema or fetch_value(conn, "SELECT current_schema()")
    out: dict[str, Rows] = {}
    for t in PROJECTION_TABLES:
        cols = tuple(c for c in _columns(conn, schema, t) if c in _ORDER[t] or c not in (exclude or {}).get(t, set()))
        sel = ", ".join(f'"{c}"' for c in cols)
        rows = conn.execute(f'SELECT {sel} FROM "{_check_ident(schema)}".{t} ORDER BY {", ".join(_ORDER[t])}')
        out[t] = Rows((tuple(r) for r in rows), cols)
    return out


def diff_projection_schemas(
    session: Session,
    a: str,
    b: str,
    *,
    limit: int = 5,
    skip_trajectories: Collection[uuid.UUID] = (),
    names: tuple[str, str] = ("first", "second"),
) -> list[str]:
    """:func:`compare_projections` of the projection tables of schemas ``a`` and ``b`` (same columns,
    as :func:`create_shadow_schema` makes them), computed by Postgres: only the differences (at most
    ``limit``) reach Python, whatever the tables' size. Rows of ``skip_trajectories`` are left out;
    ``names`` calls the two sides.

    Raises:
        ValueError: an invalid schema name.
        psycopg.Error: database faults.
    """
    conn = raw_connection(session)
    qa, qb = f'"{_check_ident(a)}"', f'"{_check_ident(b)}"'
    skip = list(skip_trajectories)
    diffs: list[str] = []
    for t in PROJECTION_TABLES:
        key, cols = _ORDER[t], _columns(conn, a, t)
        keys = ", ".join(key)
        for side, (this, other) in ((names[0], (qa, qb)), (names[1], (qb, qa))):
            first = conn.execute(  # the first key only this side has, and how many there are
                f"SELECT {keys}, count(*) OVER () FROM (SELECT {keys} FROM {this}.{t} WHERE {key[0]} <> ALL(%(skip)s) "
                f"EXCEPT SELECT {keys} FROM {other}.{t} WHERE {key[0]} <> ALL(%(skip)s)) k ORDER BY {keys} LIMIT 1",
                {"skip": skip},
            ).fetchone()
            if first:
                *values, n = first
                diffs.append(_only_in(t, n, side, values))
        if len(diffs) >= limit:
            return diffs[:limit]
        differ = ", ".join(f'CASE WHEN x."{c}" IS DISTINCT FROM y."{c}" THEN \'{c}\' END' for c in cols)
        rows = conn.execute(
            f"SELECT {', '.join(f'x.{c}' for c in key)}, array_remove(ARRAY[{differ}], NULL) "
            f"FROM {qa}.{t} x JOIN {qb}.{t} y USING ({keys}) WHERE x.{key[0]} <> ALL(%(skip)s) "
            f"AND ROW(x.*) IS DISTINCT FROM ROW(y.*) ORDER BY {', '.join(f'x.{c}' for c in key)} LIMIT %(n)s",
            {"skip": skip, "n": limit - len(diffs)},
        ).fetchall()
        diffs += [_columns_differ(t, values, columns) for *values, columns in rows]
        if len(diffs) >= limit:
            return diffs[:limit]
    return diffs


def compare_projections(
    a: dict[str, Rows], b: dict[str, Rows], limit: int = 5, names: tuple[str, str] = ("first", "second")
) -> list[str]:
    """Human-readable differences between two :func:`dump_projection` results (empty if identical),
    at most ``limit``: rows whose key only one side has, and rows of a key both have whose columns
    differ (named); ``names`` calls the two sides."""
    diffs: list[str] = []
    for t in PROJECTION_TABLES:
        ra, rb = a.get(t, Rows()), b.get(t, Rows())
        cols = ra.columns or rb.columns
        at = [cols.index(c) for c in _ORDER[t]]

        def by_key(rows: list[tuple[Any, ...]]) -> dict[tuple[Any, ...], tuple[Any, ...]]:
            return {tuple(r[i] for i in at): r for r in rows}  # noqa: B023

        ka, kb = by_key(ra), by_key(rb)
        for side, keys in ((names[0], ka.keys() - kb.keys()), (names[1], kb.keys() - ka.keys())):
            if keys:
                diffs.append(_only_in(t, len(keys), side, min(keys, key=str)))
        for key in sorted((k for k in ka.keys() & kb.keys() if ka[k] != kb[k]), key=str):
            if len(diffs) >= limit:
                break
            diffs.append(_columns_differ(t, key, [cols[j] for j, (u, v) in enumerate(zip(ka[key], kb[key])) if u != v]))
        if len(diffs) >= limit:
            return diffs[:limit]
    return diffs

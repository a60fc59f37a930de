"""Replay: rebuild the trajectory projections from ``event_log`` alone (no Kafka).

Invariant: replaying with the settings the live consumer ran with gives the same rows the live
consumer wrote (every column of ``trajectory``, ``trajectory_segment`` and ``reward_label``),
because both paths run the same fold (``consumers.batch.project_events``) over the same events in
``seq`` order with the same ingestion clock (``event_log.ingested_at``), then the same window sweep.

Two modes: into a fresh shadow schema (``--schema``; the live tables are untouched, and
``compare_projections`` diffs the two), or in place (truncate and rebuild in ONE transaction that
holds the projection lock exclusively, so ingest batches wait and readers never see a half-built
projection).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.events import validate_event
from app.repositories.events import EVENT_COLUMNS, iter_event_rows, raw_connection
from consumers.batch import PROJECTION_LOCK, project_events
from consumers.finalize import finalize_due_once
from consumers.projection import Projector, StoredEvent

PROJECTION_TABLES = ("trajectory", "trajectory_segment", "reward_label")
_IDENT = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def stored_event_from_row(row: tuple) -> StoredEvent:
    """A :class:`StoredEvent` from an ``iter_event_rows`` row (``seq, ingested_at, *EVENT_COLUMNS``).

    Raises:
        InvalidEventError: the stored payload no longer validates (a contract change without a
            schema-version bump).
    """
    seq, ingested_at, *rest = row
    data: dict[str, Any] = dict(zip(EVENT_COLUMNS, rest))
    event = validate_event({"event_id": data["event_id"], "type": data["type"],
                            "schema_version": data["schema_version"], "occurred_at": data["occurred_at"],
                            "session_id": data["session_id"], "user_id": data["user_id"],
                            "org_id": data["org_id"], "payload": data["payload"]})
    return StoredEvent(event, seq, ingested_at, data["topic"], data["partition"], data["offset"])


def _check_ident(name: str) -> str:
    if not _IDENT.match(name):
        raise ValueError(f"invalid schema name {name!r}")
    return name


def create_shadow_schema(session: Session, schema: str) -> None:
    """Create ``schema`` with empty copies (columns, defaults, indexes) of the projection tables."""
    _check_ident(schema)
    conn = raw_connection(session)
    home = conn.execute("SELECT current_schema()").fetchone()[0]
    conn.execute(f'CREATE SCHEMA "{schema}"')
    for t in PROJECTION_TABLES:
        conn.execute(f'CREATE TABLE "{schema}".{t} (LIKE "{home}".{t} INCLUDING ALL)')


def drop_schema(session: Session, schema: str) -> None:
    """Drop a shadow schema and its tables."""
    raw_connection(session).execute(f'DROP SCHEMA IF EXISTS "{_check_ident(schema)}" CASCADE')


@dataclass
class ReplayReport:
    """What a replay rebuilt."""

    events: int = 0
    trajectories: int = 0
    finalized_by_window: int = 0
    schema: str | None = None
    skipped_invalid: list[int] = field(default_factory=list)


def rebuild(session: Session, projector: Projector, *, grace_s: float, chunk: int = 5000,
            report: ReplayReport | None = None) -> ReplayReport:
    """Fold every ``event_log`` row, by ``seq``, into the (empty) projection tables the session's
    ``search_path`` resolves, then run the window sweep. Runs in the caller's transaction."""
    report = report or ReplayReport()
    conn = raw_connection(session)
    for rows in iter_event_rows(conn, chunk=chunk):
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
    report.trajectories = conn.execute("SELECT count(*) FROM trajectory").fetchone()[0]
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
            create_shadow_schema(session, schema)
            home = conn.execute("SELECT current_schema()").fetchone()[0]
            conn.execute(f'SET LOCAL search_path = "{schema}", ' + home)
        else:
            conn.execute("SELECT pg_advisory_xact_lock(%s)", (PROJECTION_LOCK,))
            conn.execute("TRUNCATE " + ", ".join(PROJECTION_TABLES))
        rebuild(session, projector, grace_s=grace_s, chunk=chunk, report=report)
    return report


_ORDER = {"trajectory": "id", "trajectory_segment": "trajectory_id, segment_index",
          "reward_label": "trajectory_id, spec"}


def dump_projection(session: Session, schema: str | None = None,
                    exclude: dict[str, set[str]] | None = None) -> dict[str, list[tuple]]:
    """Every row of the projection tables of ``schema`` (default: the current one), as tuples in key
    order, leaving out ``exclude[table]`` columns."""
    conn = raw_connection(session)
    schema = schema or conn.execute("SELECT current_schema()").fetchone()[0]
    out: dict[str, list[tuple]] = {}
    for t in PROJECTION_TABLES:
        cols = [r[0] for r in conn.execute(
            "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s "
            "ORDER BY ordinal_position", (schema, t)).fetchall()
            if r[0] not in (exclude or {}).get(t, set())]
        sel = ", ".join(f'"{c}"' for c in cols)
        rows = conn.execute(f'SELECT {sel} FROM "{_check_ident(schema)}".{t} ORDER BY {_ORDER[t]}')
        out[t] = [tuple(r) for r in rows]
    return out


def compare_projections(a: dict[str, list[tuple]], b: dict[str, list[tuple]], limit: int = 5) -> list[str]:
    """Human-readable differences between two :func:`dump_projection` results (empty if identical)."""
    diffs: list[str] = []
    for t in PROJECTION_TABLES:
        ra, rb = a.get(t, []), b.get(t, [])
        if len(ra) != len(rb):
            diffs.append(f"{t}: {len(ra)} rows vs {len(rb)} rows")
        for i, (x, y) in enumerate(zip(ra, rb)):
            if x != y:
                cols = [j for j, (u, v) in enumerate(zip(x, y)) if u != v]
                diffs.append(f"{t} row {i} (key {x[0]}): columns {cols} differ")
                if len(diffs) >= limit:
                    return diffs
    return diffs

"""Trajectory projection reads and writes on the session's connection (never commits).

Invariant: a trajectory is read ``FOR UPDATE`` before it is folded and written back as a whole row,
so the finalization sweep and the ingest batch never overwrite each other's changes. Writes replace
full rows (``ON CONFLICT DO UPDATE`` every column): the stored row is exactly the folded state.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

import numpy as np
from psycopg import Cursor
from psycopg.rows import dict_row
from sqlalchemy import ARRAY, BigInteger, Boolean, Column, DateTime, Float, Integer, LargeBinary, Table
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Session

from app.models.trajectories import Trajectory, TrajectorySegment
from app.repositories.binary import UuidArray, json_bytes, jsonb_binary, uuid_array_binary
from app.repositories.events import raw_connection

TRAJECTORY_COLUMNS = tuple(c.name for c in Trajectory.__table__.columns)
SEGMENT_COLUMNS = tuple(c.name for c in TrajectorySegment.__table__.columns if c.name != "trajectory_id")


class Label(Protocol):
    """A reward label to store (``consumers.rewards.math.RewardResult``)."""

    @property
    def spec(self) -> str: ...

    @property
    def reward(self) -> float: ...

    @property
    def components(self) -> dict[str, float]: ...


class TrajectoryLike(Protocol):
    """The folded state of a trajectory: an attribute per ``trajectory`` column, plus ``segments``
    (index -> object with an attribute per segment column, ``dirty`` and ``stored``), ``dirty``,
    ``stored`` (the row was loaded from, or already written to, the table) and ``labels``."""

    id: uuid.UUID
    finalized_at: datetime | None
    segments: dict[int, Any]
    dirty: bool
    stored: bool
    labels: list[Any]


_JSON_TRAJECTORY = {"signals"}
_JSON_SEGMENT = {"tool_calls", "tool_results", "min_offset", "max_offset"}
_BYTES_SEGMENT = {"token_ids", "loss_mask", "behaviour_logprobs", "routed_experts"}
_T_COLS = ", ".join(TRAJECTORY_COLUMNS)
_S_COLS = ", ".join(SEGMENT_COLUMNS)


T = TypeVar("T")
S = TypeVar("S")

ROUTE_DTYPES: dict[int, np.dtype[Any]] = {1: np.dtype("u1"), 2: np.dtype("<u2")}
"""``trajectory_segment.routed_experts`` item size (bytes) -> its numpy dtype."""


def pack_routes(stored: bytes | bytearray, itemsize: int | None, ids: np.ndarray) -> tuple[bytes, int]:
    """Append expert ids to a segment's stored routes, widening them to two bytes an id if needed.

    Args:
        stored: the segment's ``routed_experts`` bytes so far (``itemsize`` bytes per id).
        itemsize: their item size (None or anything when ``stored`` is empty).
        ids: ``[n]`` integer expert ids, flat ``[tokens x layers x top_k]``.

    Returns:
        ``(bytes, itemsize)``: 1 byte an id while every id (stored and new) is below 256, else 2.

    Raises:
        ValueError: an id outside ``[0, 65535]``, or ``stored`` bytes without their ``itemsize``.
    """
    ids = np.asarray(ids)
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) > 0xFFFF):
        raise ValueError(f"expert ids must lie in [0, 65535], got [{int(ids.min())}, {int(ids.max())}]")
    size = itemsize if stored else 1
    if size is None:
        raise ValueError(f"{len(stored)} stored routed_experts bytes without their item size")
    need = 2 if ids.size and int(ids.max()) > 0xFF else 1
    if need > size:
        stored, size = unpack_routes(stored, size).astype(ROUTE_DTYPES[need]).tobytes(), need
    return bytes(stored) + ids.astype(ROUTE_DTYPES[size]).tobytes(), size


def unpack_routes(raw: bytes | bytearray | memoryview | None, itemsize: int | None) -> np.ndarray:
    """Stored ``routed_experts`` bytes -> flat ``int16``/``int32`` ids ``[n]`` (empty if none).

    Raises:
        ValueError: an item size other than 1 or 2, or a byte count that is not a multiple of it.
    """
    if not raw:
        return np.zeros(0, dtype=np.int32)
    if itemsize not in ROUTE_DTYPES or len(raw) % itemsize:
        raise ValueError(f"routed_experts of {len(raw)} bytes at item size {itemsize}")
    ids: np.ndarray = np.frombuffer(bytes(raw), dtype=ROUTE_DTYPES[itemsize]).astype(np.int32)
    return ids


def _segment_from_row(row: dict[str, Any], factory: Callable[..., S]) -> S:
    row = dict(row)
    row.pop("trajectory_id", None)
    for k in _BYTES_SEGMENT:
        row[k] = bytearray(row[k] or b"")
    return factory(**row, stored=True)


def load_trajectories(
    session: Session, ids: Iterable[uuid.UUID], factory: Callable[..., T], *, lock: bool = True
) -> dict[uuid.UUID, T]:
    """Stored trajectories by id (missing ids are absent), locked ``FOR UPDATE`` in id order;
    ``factory(**columns, stored=True)`` builds each."""
    ids = sorted(set(ids))
    if not ids:
        return {}
    suffix = " FOR UPDATE" if lock else ""
    with raw_connection(session).cursor(row_factory=dict_row) as cur:
        cur.execute(f"SELECT {_T_COLS} FROM trajectory WHERE id = ANY(%b) ORDER BY id{suffix}", (UuidArray.of(ids),))
        return {r["id"]: factory(**r, stored=True) for r in cur.fetchall()}


def load_open_segments(session: Session, ids: Iterable[uuid.UUID], factory: Callable[..., S]) -> dict[uuid.UUID, S]:
    """The highest-index segment of each trajectory (the one new turns append to)."""
    ids = sorted(set(ids))
    if not ids:
        return {}
    with raw_connection(session).cursor(row_factory=dict_row) as cur:
        cur.execute(
            f"SELECT DISTINCT ON (trajectory_id) trajectory_id, {_S_COLS} FROM trajectory_segment "
            "WHERE trajectory_id = ANY(%b) ORDER BY trajectory_id, segment_index DESC",
            (UuidArray.of(ids),),
        )
        return {r["trajectory_id"]: _segment_from_row(r, factory) for r in cur.fetchall()}


def load_segment(session: Session, trajectory_id: uuid.UUID, index: int, factory: Callable[..., S]) -> S | None:
    """One stored segment, or None."""
    with raw_connection(session).cursor(row_factory=dict_row) as cur:
        cur.execute(
            f"SELECT {_S_COLS} FROM trajectory_segment WHERE trajectory_id = %s AND segment_index = %s",
            (trajectory_id, index),
        )
        row = cur.fetchone()
        return _segment_from_row(row, factory) if row else None


def _trajectory_values(t: TrajectoryLike) -> tuple[Any, ...]:
    return tuple(getattr(t, c) for c in TRAJECTORY_COLUMNS)


def _segment_values(tid: uuid.UUID, s: Any) -> tuple[Any, ...]:
    vals: list[Any] = [tid]
    for c in SEGMENT_COLUMNS:
        v = getattr(s, c)
        vals.append(bytes(v) if c in _BYTES_SEGMENT else v)
    return tuple(vals)


def _pg_type(col: Column[Any]) -> str:
    """The binary-COPY type name of a column."""
    t = col.type
    if isinstance(t, ARRAY):
        return _pg_type(Column("x", t.item_type)) + "[]"
    for kind, name in (
        (UUID, "uuid"),
        (JSONB, "jsonb"),
        (LargeBinary, "bytea"),
        (Boolean, "bool"),
        (BigInteger, "int8"),
        (Integer, "int4"),
        (DateTime, "timestamptz"),
        (Float, "float8"),
    ):
        if isinstance(t, kind):
            return name
    return "text"


def _is_uuid_array(col: Column[Any]) -> bool:
    return isinstance(col.type, ARRAY) and isinstance(col.type.item_type, UUID)


def _copy_rows(cur: Cursor[Any], target: str, table: Table, rows: list[tuple[Any, ...]]) -> None:
    """Binary COPY whole rows shaped like ``table`` into ``target`` (``table`` itself or its temp twin).

    uuid[] and jsonb values are pre-encoded in their binary formats (faster than psycopg's generic
    dumpers) and pass through its bytea dumper untouched; the server decodes them by column type.
    """
    names = ", ".join(c.name for c in table.columns)
    encoders = {
        i: uuid_array_binary if _is_uuid_array(c) else jsonb_binary
        for i, c in enumerate(table.columns)
        if _is_uuid_array(c) or isinstance(c.type, JSONB)
    }
    with cur.copy(f"COPY {target} ({names}) FROM STDIN (FORMAT BINARY)") as copy:
        copy.set_types(["bytea" if i in encoders else _pg_type(c) for i, c in enumerate(table.columns)])
        for r in rows:
            values = list(r)
            for i, encode in encoders.items():
                values[i] = encode(values[i])
            copy.write_row(values)


def _copy_upsert(cur: Cursor[Any], table: Table, key: tuple[str, ...], rows: list[tuple[Any, ...]]) -> None:
    """Upsert whole rows in one statement: binary COPY into a temp table shaped like ``table``, then
    ``INSERT .. SELECT .. ON CONFLICT (key) DO UPDATE`` every column (one executor run for the batch
    instead of one per row; bytea travels raw, not hex). The temp table keeps the columns' storage
    (no compression attempts on token bytes there either)."""
    cols = [c.name for c in table.columns]
    tmp = f"_upsert_{table.name}"
    cur.execute(
        f"CREATE TEMP TABLE IF NOT EXISTS {tmp} (LIKE {table.name} INCLUDING DEFAULTS INCLUDING STORAGE) "
        "ON COMMIT DELETE ROWS"
    )
    _copy_rows(cur, tmp, table, rows)
    names = ", ".join(cols)
    updates = ", ".join(f"{c} = EXCLUDED.{c}" for c in cols if c not in key)
    cur.execute(
        f"INSERT INTO {table.name} ({names}) SELECT {names} FROM {tmp} "
        f"ON CONFLICT ({', '.join(key)}) DO UPDATE SET {updates}"
    )
    cur.execute(f"DELETE FROM {tmp}")  # several saves may share one transaction (replay)


def _write_rows(
    cur: Cursor[Any], table: Table, key: tuple[str, ...], new: list[tuple[Any, ...]], stored: list[tuple[Any, ...]]
) -> None:
    """Rows not loaded from the table go straight in by COPY (most rows of a batch: a trajectory or
    segment is usually new in the batch that starts it); loaded ones are upserted. Were a "new" row
    inserted concurrently after all, the COPY fails with a unique violation and the consumer redoes
    the batch (isolated, in a fresh transaction that loads the row)."""
    if new:
        _copy_rows(cur, table.name, table, new)
    if stored:
        _copy_upsert(cur, table, key, stored)


def _insert_labels(
    cur: Cursor[Any],
    labels: Sequence[tuple[uuid.UUID, Label, datetime | None]],
    on_conflict: str,
    table: str = "reward_label",
) -> None:
    """Insert ``(trajectory_id, label, created_at or None for now())`` rows into ``table`` in one
    statement, ``ON CONFLICT (trajectory_id, spec)`` then ``on_conflict`` (one label per trajectory
    and spec)."""
    if not labels:
        return
    cur.execute(
        f"INSERT INTO {table} (trajectory_id, spec, reward, components, created_at) "
        "SELECT t, s, r, c::jsonb, coalesce(a, now()) FROM unnest(%b, %s::text[], %s::float8[], %s::text[], "
        f"%s::timestamptz[]) AS u(t, s, r, c, a) ON CONFLICT (trajectory_id, spec) {on_conflict}",
        (
            UuidArray.of([tid for tid, _, _ in labels]),
            [lab.spec for _, lab, _ in labels],
            [lab.reward for _, lab, _ in labels],
            [json_bytes(lab.components).decode() for _, lab, _ in labels],
            [at for _, _, at in labels],
        ),
    )


def save_trajectories(
    session: Session, states: Sequence[TrajectoryLike], label_time: datetime | None = None
) -> tuple[int, int, int]:
    """Upsert dirty trajectories, their dirty segments and any labels a finalization produced.

    Labels are inserted with ``created_at`` = the trajectory's ``finalized_at`` (so replay rebuilds
    the same rows) unless ``label_time`` is given. Clears the dirty flags and pending labels.

    Returns:
        (trajectories written, segments written, labels written)
    """
    dirty = [t for t in states if t.dirty]
    if not dirty:
        return 0, 0, 0
    segs = [(t.id, s) for t in dirty for s in t.segments.values() if s.dirty]
    labels = [(t.id, lab, label_time or t.finalized_at) for t in dirty for lab in t.labels]
    conn = raw_connection(session)
    with conn.cursor() as cur:
        _write_rows(
            cur,
            Trajectory.metadata.tables[Trajectory.__tablename__],
            ("id",),
            [_trajectory_values(t) for t in dirty if not t.stored],
            [_trajectory_values(t) for t in dirty if t.stored],
        )
        _write_rows(
            cur,
            TrajectorySegment.metadata.tables[TrajectorySegment.__tablename__],
            ("trajectory_id", "segment_index"),
            [_segment_values(tid, s) for tid, s in segs if not s.stored],
            [_segment_values(tid, s) for tid, s in segs if s.stored],
        )
        _insert_labels(cur, labels, "DO NOTHING")
    for t in dirty:
        t.dirty, t.stored = False, True
        t.labels = []
        for s in t.segments.values():
            s.dirty = False
            s.stored = True
    return len(dirty), len(segs), len(labels)


def due_for_window(
    session: Session, now: datetime, grace_s: float, factory: Callable[..., T], limit: int = 500
) -> dict[uuid.UUID, T]:
    """Provisional trajectories whose window closed at least ``grace_s`` seconds before ``now``, locked
    ``FOR UPDATE SKIP LOCKED`` (a batch folding into one of them is left alone until next sweep)."""
    with raw_connection(session).cursor(row_factory=dict_row) as cur:
        cur.execute(
            f"SELECT {_T_COLS} FROM trajectory WHERE status = 'provisional' "
            "AND window_closes_at < %s - make_interval(secs => %s) ORDER BY window_closes_at, id "
            "LIMIT %s FOR UPDATE SKIP LOCKED",
            (now, grace_s, limit),
        )
        return {r["id"]: factory(**r, stored=True) for r in cur.fetchall()}


RELABEL_STAGE = "relabel_stage"
"""The temporary table (dropped at commit) :func:`stage_labels` fills and :func:`apply_staged_labels`
copies into ``reward_label``."""


def create_label_stage(session: Session) -> None:
    """Create :data:`RELABEL_STAGE` in the caller's transaction; it is dropped when the transaction
    ends. It has no foreign key: staged rows take no lock on ``trajectory``, so an erasure while a
    relabel scans is neither blocked by it nor fails it.

    Raises:
        psycopg.Error: database faults (the table exists already in this transaction, say).
    """
    raw_connection(session).execute(
        f"CREATE TEMP TABLE {RELABEL_STAGE} (trajectory_id uuid, spec text, reward float8 NOT NULL, "
        "components jsonb NOT NULL, created_at timestamptz NOT NULL, PRIMARY KEY (trajectory_id, spec)) "
        "ON COMMIT DROP"
    )


def stage_labels(session: Session, labels: Sequence[tuple[uuid.UUID, Label]]) -> int:
    """Stage labels of a relabel in :data:`RELABEL_STAGE` (:func:`create_label_stage` first).
    Returns rows staged.

    Raises:
        psycopg.Error: database faults.
    """
    with raw_connection(session).cursor() as cur:
        _insert_labels(
            cur,
            [(tid, lab, None) for tid, lab in labels],
            "DO UPDATE SET reward = EXCLUDED.reward, components = EXCLUDED.components",
            RELABEL_STAGE,
        )
    return len(labels)


def apply_staged_labels(session: Session) -> list[tuple[uuid.UUID, float]]:
    """Insert or replace the staged labels in ``reward_label``, in one statement, for the trajectories
    that still exist: each is locked ``FOR KEY SHARE`` first, so one an erasure deleted since it was
    staged (or is deleting: the statement waits for it) is skipped, not a foreign-key violation.

    Returns:
        (trajectory_id, reward) of every label written.
    Raises:
        psycopg.Error: database faults.
    """
    return (
        raw_connection(session)
        .execute(
            "INSERT INTO reward_label (trajectory_id, spec, reward, components, created_at) "
            f"SELECT s.trajectory_id, s.spec, s.reward, s.components, s.created_at FROM {RELABEL_STAGE} s "
            "JOIN trajectory t ON t.id = s.trajectory_id FOR KEY SHARE OF t "
            "ON CONFLICT (trajectory_id, spec) DO UPDATE SET reward = EXCLUDED.reward, "
            "components = EXCLUDED.components, created_at = EXCLUDED.created_at "
            "RETURNING trajectory_id, reward"
        )
        .fetchall()
    )


def rewards_for_spec(session: Session, spec: str) -> list[float]:
    """Every stored reward under ``spec``."""
    with raw_connection(session).cursor() as cur:
        cur.execute("SELECT reward FROM reward_label WHERE spec = %s", (spec,))
        return [r[0] for r in cur.fetchall()]

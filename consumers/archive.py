"""The ``event_log`` archive: partitions past retention as Parquet files at an fsspec URL, read back
by replay and relabel as if still stored, and rewritten by erasure.

Invariants:

- A partition leaves Postgres only after its file is verified: written from the partition under a
  ``SHARE`` lock (no insert or delete reaches it meanwhile), read back from the URL, its row count
  and :func:`rows_digest` equal to the partition's; then, in the same transaction, its
  ``event_archive`` row is inserted and the partition detached and dropped. A failed check raises
  :class:`ArchiveMismatch` and keeps the partition. A crash before the commit leaves at most a file
  no catalog row names, which the next pass overwrites.
- ``event_archive`` says what each file holds now (rows, digest). An erasure rewrites a file
  holding the user's rows without them (to a temporary name, then moved over), updates its row,
  and records an audit entry ``event_archive.rewritten``, all under the row's ``FOR UPDATE`` lock,
  so two erasures never rewrite one file from the same old version.
- :func:`iter_stored_rows` yields the rows of the archive and of ``event_log`` in one order
  (``seq``, or session then ``seq``), in ``app.repositories.events.iter_event_rows``' row shape, so
  replay and relabel read archived days without knowing. Files are written in ``seq`` order and
  read a batch at a time; the session order sorts each file in memory (one file per archived
  partition, all open at once: a relabel holds the archive's rows for that order).

Sources: Apache Parquet through pyarrow (``pyarrow.parquet``); fsspec for ``file://``, ``s3://``
(s3fs) and ``gs://`` (gcsfs) URLs, a plain path being a local file.
"""

from __future__ import annotations

import hashlib
import heapq
import itertools
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import fsspec
import orjson
import psycopg
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock
from app.repositories.audit import record_audit
from app.repositories.events import EVENT_COLUMNS, iter_event_rows, raw_connection
from consumers.partitions import Partition, list_partitions

ARCHIVE_COLUMNS = ("seq", "ingested_at", *EVENT_COLUMNS)
"""A file's columns: ``iter_event_rows``' row shape (``payload`` as its JSON text, ``event_id`` as text)."""

_TS = pa.timestamp("us", tz="UTC")
SCHEMA = pa.schema(
    [
        ("seq", pa.int64()),
        ("ingested_at", _TS),
        ("event_id", pa.string()),
        ("type", pa.string()),
        ("schema_version", pa.int32()),
        ("occurred_at", _TS),
        ("session_id", pa.string()),
        ("user_id", pa.string()),
        ("org_id", pa.string()),
        ("payload", pa.string()),
        ("topic", pa.string()),
        ("partition", pa.int32()),
        ("offset", pa.int64()),
        ("trace_id", pa.string()),
        ("producer_seq", pa.int32()),
        ("span_id", pa.string()),
    ]
)
_SELECT = ", ".join(f'"{c}"' if c != "payload" else "payload::text" for c in ARCHIVE_COLUMNS)
_SESSION_COL = ARCHIVE_COLUMNS.index("session_id")


class ArchiveMismatch(RuntimeError):
    """A written file does not hold what its partition holds (row count or digest): the partition is kept."""


@dataclass(frozen=True)
class ArchivedPartition:
    """One partition as archived: its file, rows and :func:`rows_digest` (hex)."""

    name: str
    start: datetime
    end: datetime
    url: str
    rows: int
    sha256: str


def archive_url(root: str, name: str) -> str:
    """The file of partition ``name`` under the archive ``root`` (an fsspec URL or a path)."""
    return f"{root.rstrip('/')}/event_log/{name}.parquet"


def _canonical(row: Sequence[Any]) -> bytes:
    """One row as the bytes the digest hashes: JSON of its values, times in UTC, ids as text."""
    return orjson.dumps(
        [
            v.astimezone(UTC).isoformat() if isinstance(v, datetime) else str(v) if isinstance(v, uuid.UUID) else v
            for v in row
        ]
    )


def rows_digest(rows: Iterable[Sequence[Any]], digest: Any = None) -> Any:
    """SHA-256 over ``rows`` (:data:`ARCHIVE_COLUMNS` order, ``payload`` as text), one canonical JSON
    line a row, in the order given. Returns the ``hashlib`` object (pass it back to continue)."""
    digest = digest or hashlib.sha256()
    for row in rows:
        digest.update(_canonical(row))
        digest.update(b"\n")
    return digest


def _batch(rows: Sequence[Sequence[Any]]) -> pa.RecordBatch:
    cols = [list(c) for c in zip(*rows)]
    cols[2] = [str(u) for u in cols[2]]
    return pa.RecordBatch.from_arrays([pa.array(c, type=f.type) for c, f in zip(cols, SCHEMA)], schema=SCHEMA)


def _rows(batch: pa.RecordBatch | pa.Table) -> list[tuple[Any, ...]]:
    """A batch's rows as tuples in :data:`ARCHIVE_COLUMNS` order (``event_id`` a UUID, payload text)."""
    cols = [batch.column(i).to_pylist() for i in range(batch.num_columns)]
    cols[2] = [uuid.UUID(u) for u in cols[2]]
    return list(zip(*cols))


def _file_digest(url: str) -> tuple[int, str]:
    """Row count and :func:`rows_digest` of the file at ``url``, read back from storage."""
    digest, n = hashlib.sha256(), 0
    with fsspec.open(url, "rb") as f:
        for batch in pq.ParquetFile(f).iter_batches(batch_size=10_000):
            rows = _rows(batch)
            n += len(rows)
            rows_digest(rows, digest)
    return n, digest.hexdigest()


def archive_partition(
    conn: psycopg.Connection, part: Partition, root: str, *, chunk: int = 10_000
) -> ArchivedPartition:
    """Write ``part`` to Parquet under ``root``, verify the file against it, catalogue it, then
    detach and drop the partition, in the caller's transaction (which must commit for the drop).

    Raises:
        ArchiveMismatch: the file read back does not hold the partition's rows.
        psycopg.Error, OSError: database or storage faults (the partition stays).
    """
    conn.execute(f"LOCK TABLE {part.name} IN SHARE MODE")  # no erasure or late insert meanwhile
    (expected,) = conn.execute(f"SELECT count(*) FROM {part.name}").fetchone()  # type: ignore[misc]
    url = archive_url(root, part.name)
    digest, written = hashlib.sha256(), 0
    with fsspec.open(url, "wb", auto_mkdir=True) as f, pq.ParquetWriter(f, SCHEMA, compression="zstd") as out:
        with conn.cursor(name=f"archive_{part.name}") as cur:
            cur.execute(f"SELECT {_SELECT} FROM {part.name} ORDER BY seq")
            while rows := cur.fetchmany(chunk):
                out.write_batch(_batch(rows))
                rows_digest(rows, digest)
                written += len(rows)
        if written == 0:
            out.write_table(SCHEMA.empty_table())
    n, file_sha = _file_digest(url)
    if (n, file_sha) != (expected, digest.hexdigest()) or written != expected:
        raise ArchiveMismatch(
            f"{url}: {n} rows (digest {file_sha[:12]}) read back, partition {part.name} holds {expected} "
            f"(digest {digest.hexdigest()[:12]}); the partition is kept"
        )
    conn.execute(
        "INSERT INTO event_archive (partition_name, range_start, range_end, url, rows, sha256) "
        "VALUES (%s, %s, %s, %s, %s, %s) ON CONFLICT (partition_name) DO UPDATE SET url = EXCLUDED.url, "
        "rows = EXCLUDED.rows, sha256 = EXCLUDED.sha256, archived_at = now()",
        (part.name, part.start, part.end, url, n, file_sha),
    )
    conn.execute(f"ALTER TABLE event_log DETACH PARTITION {part.name}")
    conn.execute(f"DROP TABLE {part.name}")
    return ArchivedPartition(part.name, part.start, part.end, url, n, file_sha)


def partitions_due(conn: psycopg.Connection, *, retention_days: int, now: datetime) -> list[Partition]:
    """The partitions whose range ended ``retention_days`` or more before ``now``, oldest first."""
    cutoff = now - timedelta(days=retention_days)
    return [p for p in list_partitions(conn) if p.end <= cutoff]


def archive_due(
    session_factory: Callable[[], Any], *, root: str, retention_days: int, now: datetime
) -> list[ArchivedPartition]:
    """Archive every partition past retention, one transaction each (``session_factory``: a context
    manager yielding a SQLAlchemy session that commits on exit, e.g. ``app.core.db.session_scope``).
    Single-flight with partition creation (a try-lock): a pass already running makes this one do nothing.

    Returns:
        the partitions archived, oldest first.
    """
    done: list[ArchivedPartition] = []
    while True:
        with session_factory() as session:
            conn = raw_connection(session)
            if not conn.execute("SELECT pg_try_advisory_xact_lock(%s)", (AdvisoryLock.EVENT_PARTITIONS,)).fetchone()[0]:  # type: ignore[index]
                return done
            due = partitions_due(conn, retention_days=retention_days, now=now)
            if not due:
                return done
            done.append(archive_partition(conn, due[0], root))


def archived_files(conn: psycopg.Connection, *, until: datetime | None = None) -> list[tuple[str, str]]:
    """``(partition name, url)`` of archived partitions (those starting at or before ``until``), oldest first."""
    where, params = ("WHERE range_start <= %s", (until,)) if until is not None else ("", ())
    return [
        (r[0], r[1])
        for r in conn.execute(
            f"SELECT partition_name, url FROM event_archive {where} ORDER BY range_start", params
        ).fetchall()
    ]


def _file_rows(url: str, order: Literal["seq", "session"], chunk: int) -> Iterator[tuple[Any, ...]]:
    """An archived file's rows in ``iter_event_rows``' shape (``payload`` parsed), in ``order``."""
    with fsspec.open(url, "rb") as f:
        pf = pq.ParquetFile(f)
        if order == "session":
            batches: Iterable[pa.RecordBatch | pa.Table] = [
                pf.read().sort_by([("session_id", "ascending"), ("seq", "ascending")])
            ]
        else:
            batches = pf.iter_batches(batch_size=chunk)
        for batch in batches:
            for row in _rows(batch):
                yield (*row[:9], orjson.loads(row[9]), *row[10:])


def iter_stored_rows(
    conn: psycopg.Connection,
    *,
    order: Literal["seq", "session"] = "seq",
    where: str = "TRUE",
    params: Sequence[Any] = (),
    chunk: int = 5000,
) -> Iterator[list[tuple[Any, ...]]]:
    """Every stored event, archived or in ``event_log``, in chunks of ``iter_event_rows`` rows, by
    ``seq`` (``order="seq"``) or by session id then ``seq``. ``where`` filters the ``event_log``
    rows only (archived rows all come: callers filter what they fold)."""
    files = [_file_rows(url, order, chunk) for _, url in archived_files(conn)]
    # Merged with Arrow's byte order, the session ids sort by code point (UTF-8 bytes): "C".
    sql_order = "seq" if order == "seq" else 'session_id COLLATE "C", seq' if files else "session_id, seq"
    live = itertools.chain.from_iterable(
        iter_event_rows(conn, where=where, params=params, order=sql_order, chunk=chunk)
    )
    key: Callable[[tuple[Any, ...]], Any] = (lambda r: r[0]) if order == "seq" else (lambda r: (r[_SESSION_COL], r[0]))
    merged = heapq.merge(live, *files, key=key) if files else live
    while rows := list(itertools.islice(merged, chunk)):
        yield rows


def archived_sessions(conn: psycopg.Connection, user_id: str, until: datetime) -> set[str]:
    """Session ids of ``user_id``'s archived events at or before ``until`` (what an erasure covers)."""
    out: set[str] = set()
    for _, url in archived_files(conn, until=until):
        with fsspec.open(url, "rb") as f:
            t = pq.read_table(f, columns=["session_id", "user_id", "occurred_at"])
        mask = pc.and_(pc.equal(t["user_id"], user_id), pc.less_equal(t["occurred_at"], pa.scalar(until, _TS)))
        out.update(t.filter(mask)["session_id"].to_pylist())
    return out


def _erased_mask(table: pa.Table, user_id: str, sessions: pa.Array) -> pa.ChunkedArray:
    """Which rows of ``table`` are ``user_id``'s in one of ``sessions`` (what an erasure removes)."""
    return pc.and_(pc.equal(table["user_id"], user_id), pc.is_in(table["session_id"], value_set=sessions))


def _count(mask: pa.ChunkedArray) -> int:
    return int(pc.sum(pc.cast(mask, pa.int64())).as_py() or 0)


def erase_archived(session: Session, user_id: str, sessions: Iterable[str], *, until: datetime, request_id: str) -> int:
    """Rewrite every archived file holding ``user_id``'s rows of ``sessions`` without them, in the
    caller's transaction (catalog rows locked ``FOR UPDATE``), with an audit entry per file.

    Returns:
        the archived rows removed.
    Raises:
        psycopg.Error, OSError: database or storage faults.
    """
    conn = raw_connection(session)
    wanted = pa.array(sorted(set(sessions)), type=pa.string())
    removed = 0
    rows = conn.execute(
        "SELECT partition_name, url FROM event_archive WHERE range_start <= %s ORDER BY range_start FOR UPDATE",
        (until,),
    ).fetchall()
    for name, url in rows:
        with fsspec.open(url, "rb") as f:  # two columns first: most files hold none of the user's rows
            keys = pq.read_table(f, columns=["session_id", "user_id"])
        if not _count(_erased_mask(keys, user_id, wanted)):
            continue
        with fsspec.open(url, "rb") as f:
            table = pq.read_table(f, schema=SCHEMA)
        gone = _erased_mask(table, user_id, wanted)
        k = _count(gone)
        kept = table.filter(pc.invert(gone))
        tmp = f"{url}.{uuid.uuid4().hex[:8]}.tmp"
        with fsspec.open(tmp, "wb") as f:
            pq.write_table(kept, f, compression="zstd")
        fs, path = fsspec.core.url_to_fs(url)
        fs.mv(fsspec.core.url_to_fs(tmp)[1], path)
        n, sha = _file_digest(url)
        conn.execute(
            "UPDATE event_archive SET rows = %s, sha256 = %s, rewritten_at = now(), rows_erased = rows_erased + %s "
            "WHERE partition_name = %s",
            (n, sha, k, name),
        )
        record_audit(
            session,
            actor="consumers:erasure",
            action="event_archive.rewritten",
            target=f"event_archive:{name}",
            details={"request_id": request_id, "user_id": user_id, "rows_removed": k, "rows": n},
        )
        removed += k
    return removed

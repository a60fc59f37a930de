"""The ``event_log`` archive: a partition past retention goes to Parquet, verified, then dropped;
replay and relabel read it as if stored; an erasure rewrites it without the user's rows, audited."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import psycopg
import pyarrow.parquet as pq
import pytest

from consumers.testing import generate_stream, kafka_record

pytestmark = pytest.mark.integration


def _ingest(n: int, seed: int, group: str = "g") -> None:
    """Ingest a stream of about ``n`` events (the last two hours' days get their partitions back if
    an earlier test archived them)."""
    from app.core.db import session_scope
    from consumers.batch import apply_batch
    from consumers.classify import Message, classify
    from consumers.ingest import projector_from_settings
    from consumers.partitions import Partition, create_partition, floor_period, list_partitions, partition_name

    now = datetime.now(UTC)
    with psycopg.connect(_url()) as conn:
        have = {p.start for p in list_partitions(conn)}
        for day in sorted({floor_period(now - timedelta(hours=h), "day") for h in (0, 1, 2, 3)}):
            if day not in have:
                create_partition(conn, Partition(partition_name(day), day, day + timedelta(days=1)))
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(generate_stream(n, seed=seed))]
    with session_scope() as s:
        apply_batch(s, group, [classify(m, 1 << 20) for m in msgs], projector_from_settings())


def _stored(order: str) -> list[tuple]:
    from app.core.db import session_scope
    from app.repositories.events import raw_connection
    from consumers.archive import iter_stored_rows

    with session_scope() as s:
        return [r for rows in iter_stored_rows(raw_connection(s), order=order, chunk=97) for r in rows]  # type: ignore[arg-type]


def _archive_all(root: str) -> list:
    """Archive every partition holding rows, as beat's pass would once they are past retention."""
    from app.core.db import session_scope
    from consumers.archive import archive_due

    with psycopg.connect(_url()) as conn:
        ends = [r[0] for r in conn.execute("SELECT max(occurred_at) FROM event_log").fetchall()]
    return archive_due(session_scope, root=root, retention_days=1, now=ends[0] + timedelta(days=3))


def _url() -> str:
    import os

    return os.environ["FLYWHEEL_DATABASE_URL"]


def test_an_archived_partition_is_verified_dropped_and_read_back_by_replay_and_relabel(db, tmp_path):
    from consumers.relabel import relabel

    _ingest(400, seed=51)
    by_seq, by_session = _stored("seq"), _stored("session")
    before = relabel("implicit@1").to_dict()
    done = _archive_all(str(tmp_path))
    assert done and sum(a.rows for a in done) == len(by_seq)
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone() == (0,)
        catalog = conn.execute("SELECT partition_name, rows, sha256, url FROM event_archive").fetchall()
        kept = {r[0] for r in conn.execute("SELECT relname FROM pg_class WHERE relname LIKE 'event_log_p%'")}
    assert {c[0] for c in catalog} == {a.name for a in done} and not kept & {a.name for a in done}
    assert all(pq.read_metadata(url).num_rows == rows for _, rows, _, url in catalog)
    assert _stored("seq") == by_seq and _stored("session") == by_session  # the archive reads as stored
    after = relabel("implicit@1").to_dict()
    assert after == before

    from consumers.ingest import projector_from_settings
    from consumers.replay import replay

    report = replay(projector_from_settings(), grace_s=0.0, schema="from_archive")
    assert report.events == len(by_seq)


def test_a_file_that_does_not_read_back_as_written_keeps_its_partition(db, tmp_path, monkeypatch):
    from consumers import archive

    _ingest(120, seed=52)
    monkeypatch.setattr(archive, "_file_digest", lambda url: (0, "0" * 64))
    with pytest.raises(archive.ArchiveMismatch, match="the partition is kept"):
        _archive_all(str(tmp_path))
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] > 0
        assert conn.execute("SELECT count(*) FROM event_archive").fetchone() == (0,)


def test_an_erased_users_events_are_in_neither_postgres_nor_the_archive(db, tmp_path):
    """Half the stream archived, half still in Postgres: the erasure deletes the user's live rows,
    rewrites the archived files holding theirs (an audit entry each, the catalog's rows and digest
    those of the new file), and leaves every other user's rows where they were."""
    from app.core.db import session_scope
    from consumers.archive import _file_digest
    from consumers.erasure import erase_now

    _ingest(300, seed=53)
    done = _archive_all(str(tmp_path))
    with psycopg.connect(db) as conn:
        archived_users = {r[0] for r in conn.execute("SELECT DISTINCT user_id FROM trajectory")}
    _ingest(200, seed=54, group="g2")  # newer events of the same users stay in Postgres
    with psycopg.connect(db) as conn:
        live_users = {r[0] for r in conn.execute("SELECT DISTINCT user_id FROM event_log")}
    rows = _stored("seq")
    victim = sorted(archived_users & live_users)[0]
    mine = [r for r in rows if r[7] == victim]
    with psycopg.connect(db) as conn:
        live_before = conn.execute("SELECT count(*) FROM event_log WHERE user_id = %s", (victim,)).fetchone()[0]
    archived_before = sum(1 for a in done for r in pq.read_table(a.url).to_pylist() if r["user_id"] == victim)
    assert live_before and archived_before
    with session_scope() as s:
        out = erase_now(s, victim, "req-archive")
    assert out.archived_events_deleted == archived_before
    assert out.events_deleted == len(mine) == live_before + archived_before
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id = %s", (victim,)).fetchone() == (0,)
        audits = conn.execute(
            "SELECT target, details FROM audit_log WHERE action = 'event_archive.rewritten'"
        ).fetchall()
        catalog = conn.execute("SELECT url, rows, sha256, rows_erased FROM event_archive").fetchall()
    for url, n, sha, _ in catalog:
        assert victim not in pq.read_table(url, columns=["user_id"])["user_id"].to_pylist()
        assert _file_digest(url) == (n, sha)
    assert sum(c[3] for c in catalog) == archived_before == sum(d["rows_removed"] for _, d in audits)
    assert all(d["user_id"] == victim and d["request_id"] == "req-archive" for _, d in audits)
    assert [r for r in _stored("seq") if r[7] == victim] == []
    assert [r for r in _stored("seq") if r[7] != victim] == [r for r in rows if r[7] != victim]

"""``event_log`` partitioned by ``occurred_at``: the in-place migration of a populated table, the
partitions beat creates ahead (and the default partition's rows they take over), and dedupe across
partitions (a redelivery is refused by the ``(event_id, occurred_at)`` key; an id re-sent with
another time within the window is found by the lookup)."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import psycopg
import pytest

pytestmark = pytest.mark.integration

ROW = (
    "INSERT INTO event_log (event_id, type, schema_version, occurred_at, session_id, user_id, org_id, payload, "
    'topic, "partition", "offset") VALUES (%s, %s, 1, %s, %s, %s, %s, %s, %s, 0, %s)'
)
COLS = "seq, event_id, type, occurred_at, session_id, user_id, payload::text, ingested_at"


def test_a_populated_event_log_is_partitioned_in_place_and_back(empty_database):
    """At 0022 an unpartitioned ``event_log`` holds 3 days of events (seq values from the
    sequence's blocks); the upgrade makes one partition per day it holds plus today and 3 days
    ahead and a default one, keeps every row as it was (seq, ingested_at, payload text), keeps the
    append-only trigger, and the sequence goes on from where it was. The downgrade brings it back."""
    from app.core.migrate import downgrade, upgrade
    from consumers.partitions import list_partitions

    url = empty_database
    upgrade(url=url, revision="0022")
    days = [datetime(2026, 11, d, 12, tzinfo=UTC) for d in (3, 4, 9)]
    with psycopg.connect(url) as conn:
        for i in range(300):
            at = days[i % 3] + timedelta(seconds=i)
            conn.execute(
                ROW,
                (
                    uuid.uuid4(),
                    "session.started",
                    at,
                    f"s{i % 17}",
                    f"u{i % 5}",
                    "o",
                    json.dumps({"i": i, "text": "x " * (i % 40)}),
                    "t",
                    i,
                ),
            )
        before = conn.execute(f"SELECT {COLS} FROM event_log ORDER BY seq").fetchall()
    upgrade(url=url)
    with psycopg.connect(url) as conn:
        after = conn.execute(f"SELECT {COLS} FROM event_log ORDER BY seq").fetchall()
        parts = list_partitions(conn)
        assert conn.execute("SELECT relkind FROM pg_class WHERE relname = 'event_log'").fetchone() == ("p",)
        assert conn.execute("SELECT count(*) FROM event_log_default").fetchone() == (0,)
        per_day = dict(conn.execute("SELECT tableoid::regclass::text, count(*) FROM event_log GROUP BY 1").fetchall())
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute("UPDATE event_log SET type = 'x' WHERE seq = %s", (before[0][0],))
        conn.rollback()
        conn.execute(ROW, (uuid.uuid4(), "session.started", days[0], "s", "u", "o", "{}", "t", 999))
        (new_seq,) = conn.execute("SELECT max(seq) FROM event_log").fetchone()
        conn.rollback()
    assert after == before
    today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
    names = [p.name for p in parts]
    assert names[:3] == ["event_log_p20261103", "event_log_p20261104", "event_log_p20261109"]
    assert names[-4:] == [f"event_log_p{today + timedelta(days=d):%Y%m%d}" for d in range(4)]
    assert per_day == {"event_log_p20261103": 100, "event_log_p20261104": 100, "event_log_p20261109": 100}
    assert new_seq > before[-1][0]
    downgrade(url=url, revision="0022")
    with psycopg.connect(url) as conn:
        assert conn.execute(f"SELECT {COLS} FROM event_log ORDER BY seq").fetchall() == before
        assert conn.execute("SELECT relkind FROM pg_class WHERE relname = 'event_log'").fetchone() == ("r",)


def test_partitions_are_created_ahead_and_take_the_default_partitions_rows(db):
    """Beat's pass extends the range ``ahead`` periods past now (day or week bounds, contiguous from
    the last one), moves rows the default partition held for a new range into it, and a second pass
    creates nothing."""
    from consumers.partitions import ensure_partitions, list_partitions

    with psycopg.connect(db) as conn:
        last = list_partitions(conn)[-1]
        ahead = last.end + timedelta(days=4, hours=3)  # an event stamped past every partition: the default one
        conn.execute(ROW, (uuid.uuid4(), "session.started", ahead, "s", "u", "o", "{}", "t", 1))
        assert conn.execute("SELECT count(*) FROM event_log_default").fetchone() == (1,)
        now = last.end + timedelta(days=2)
        made = ensure_partitions(conn, period="week", ahead=1, now=now)
        assert made[0].start == last.end and all(p.end == q.start for p, q in zip(made, made[1:]))
        assert made[-1].end.weekday() == 0 and made[-1].end > now + timedelta(days=7)
        assert conn.execute("SELECT count(*) FROM event_log_default").fetchone() == (0,)
        assert conn.execute('SELECT tableoid::regclass::text FROM event_log WHERE "offset" = 1').fetchone()[0] in {
            p.name for p in made
        }
        assert ensure_partitions(conn, period="week", ahead=1, now=now) == []
        conn.rollback()


def test_a_redelivery_is_refused_in_its_partition_and_an_id_resent_within_the_window_is_found(db):
    """Two batches on two days' partitions, appended twice by every method: stored once. An id sent
    again with an ``occurred_at`` 10 minutes later (inside the 1 h window) is not stored again by
    ``copy``; 2 h later it is a new row (the documented bound)."""
    from app.core.db import session_scope
    from app.repositories.events import EventRow, append_events

    base = datetime.now(UTC).replace(hour=23, minute=59, second=0, microsecond=0)

    def row(i: int, at: datetime, eid: uuid.UUID | None = None) -> EventRow:
        return EventRow(eid or uuid.UUID(int=i + 1), "session.started", 1, at, f"s{i}", "u", "o", "{}", "t", 0, i, None)

    rows = [row(i, base + timedelta(seconds=30 * i)) for i in range(6)]  # across midnight
    with session_scope() as s:
        assert len(append_events(s, rows)) == 6
        for method in ("copy", "copy_upsert", "unnest"):
            assert append_events(s, rows, method) == {}  # type: ignore[arg-type]
        assert append_events(s, [row(0, rows[0].occurred_at + timedelta(minutes=10), rows[0].event_id)]) == {}
        assert len(append_events(s, [row(0, rows[0].occurred_at + timedelta(hours=2), rows[0].event_id)])) == 1
    with psycopg.connect(db) as conn:
        spread = conn.execute("SELECT count(DISTINCT tableoid) FROM event_log").fetchone()[0]
        assert conn.execute("SELECT count(*) FROM event_log").fetchone() == (7,)
    assert spread >= 2

"""A broker that comes back with an empty log while the group's offsets stay in Postgres (the local
stack after ``demo --down``; a topic re-created or a cluster restored in production): every event
produced afterwards is stored, and the reset is reported, never silent (real tansu, real Postgres)."""

from __future__ import annotations

import uuid

import psycopg
import pytest

from consumers.testing import generate_stream, kafka_record, produce, scalar

pytestmark = pytest.mark.integration

TOPIC, DLQ = "interactions", "interactions.dlq"


@pytest.fixture
def restartable_broker(tmp_path):
    """``(bootstrap, restart)``: a tansu broker of this test on a fixed port; ``restart()`` stops it
    and starts a new one on the same port, with an empty log and the test's topics created again."""
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from ops.broker import create_topics, start_broker

    port = free_port()
    state = {"broker": start_broker(tmp_path / "broker", port)}
    bootstrap = state["broker"].bootstrap
    create_topics(bootstrap, {TOPIC: 2, DLQ: 1})

    def restart() -> None:
        stop_pid(state["broker"].pid)
        state["broker"] = start_broker(tmp_path / "broker", port)
        create_topics(bootstrap, {TOPIC: 2, DLQ: 1})

    try:
        yield bootstrap, restart
    finally:
        stop_pid(state["broker"].pid)


def _consumer(bootstrap: str, group: str, **overrides):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.ingest import IngestConsumer
    from consumers.settings import get_consumer_settings
    from consumers.telemetry import ConsumerMetrics

    settings = get_consumer_settings().model_copy(update={"retry_max_wait_s": 1.0, **overrides})
    consumer = IngestConsumer(bootstrap=bootstrap, topic=TOPIC, group_id=group, dlq_topic=DLQ, settings=settings)
    reader = InMemoryMetricReader()
    consumer.metrics = ConsumerMetrics(TOPIC, group, MeterProvider(metric_readers=[reader]).get_meter("t"))
    return consumer, reader


def _resets(reader) -> dict[int, int]:
    points = [
        p
        for rm in (reader.get_metrics_data() or _Empty).resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "flywheel.consumer.offset_resets"
        for p in m.data.data_points
    ]
    return {p.attributes["partition"]: p.value for p in points}


class _Empty:
    resource_metrics: list = []


def _stored_offsets(db: str, group: str) -> dict[int, int]:
    with psycopg.connect(db) as conn:
        return dict(
            conn.execute("SELECT partition, next_offset FROM consumer_offset WHERE group_id = %s", (group,)).fetchall()
        )


def test_a_restarted_empty_log_is_read_from_its_start_and_every_new_event_is_stored(db, restartable_broker, caplog):
    bootstrap, restart = restartable_broker
    group = f"restart-{uuid.uuid4().hex[:8]}"
    first, second = generate_stream(400, seed=71), generate_stream(120, seed=72)
    produce(bootstrap, TOPIC, [kafka_record(e) for e in first])
    consumer, _ = _consumer(bootstrap, group)
    assert consumer.run(idle_exit_s=3.0).stored == len(first)
    before = _stored_offsets(db, group)
    assert sum(before.values()) == len(first)

    restart()
    produce(bootstrap, TOPIC, [kafka_record(e) for e in second])  # fewer: every log ends below its stored offset
    consumer, reader = _consumer(bootstrap, group)
    with caplog.at_level("ERROR", logger="consumers.offsets"):
        stats = consumer.run(idle_exit_s=3.0)
    assert stats.stored == len(second) and stats.dead_letters == {}
    assert scalar(db, "SELECT count(*) FROM event_log") == len(first) + len(second)
    assert sum(_stored_offsets(db, group).values()) == len(second)
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert len(errors) == 2 and all("log was re-created" in e and "re-reading" in e for e in errors)
    for p, stored in before.items():
        assert any(
            f"{TOPIC}:{p}: " in e and f"the stored next offset {stored} counts in the old log" in e for e in errors
        )
    assert _resets(reader) == {0: 1, 1: 1}


def test_a_restarted_log_refilled_past_the_stored_offsets_is_told_by_its_identity(db, restartable_broker, caplog):
    """Offsets alone cannot see it: the new log already holds more records than the stored offsets
    count. The log's identity (the broker's topic id, stored with the offsets) changed, so every
    partition is re-read from its start: each new event stored once, the reset logged at ERROR."""
    bootstrap, restart = restartable_broker
    group = f"restart-{uuid.uuid4().hex[:8]}"
    first, second = generate_stream(150, seed=81), generate_stream(600, seed=82)
    produce(bootstrap, TOPIC, [kafka_record(e) for e in first])
    consumer, _ = _consumer(bootstrap, group)
    assert consumer.run(idle_exit_s=3.0).stored == len(first)
    with psycopg.connect(db) as conn:
        ids = {r[0] for r in conn.execute("SELECT log_id FROM consumer_offset WHERE group_id = %s", (group,))}
    assert len(ids) == 1 and None not in ids

    restart()
    produce(bootstrap, TOPIC, [kafka_record(e) for e in second])
    ends = _log_ends(bootstrap)
    before = _stored_offsets(db, group)
    assert all(ends[p] >= before[p] for p in before), (ends, before)  # offsets cannot tell
    consumer, reader = _consumer(bootstrap, group)
    with caplog.at_level("ERROR", logger="consumers.offsets"):
        stats = consumer.run(idle_exit_s=3.0)
    assert stats.stored == len(second) and stats.dead_letters == {}
    assert scalar(db, "SELECT count(*) FROM event_log") == len(first) + len(second)
    assert _stored_offsets(db, group) == ends
    errors = [r.getMessage() for r in caplog.records if r.levelname == "ERROR"]
    assert sorted(int(e.split(":")[1]) for e in errors) == sorted(before), errors
    assert all("log was re-created" in e and "re-reading" in e for e in errors)
    assert _resets(reader) == {p: 1 for p in before}
    with psycopg.connect(db) as conn:
        now = {r[0] for r in conn.execute("SELECT log_id FROM consumer_offset WHERE group_id = %s", (group,))}
    assert len(now) == 1 and now != ids


def _log_ends(bootstrap: str) -> dict[int, int]:
    """Each non-empty partition's log end, read record by record (tansu's ListOffsets under-reports)."""
    from tests.fixtures.broker import read_topic

    ends: dict[int, int] = {}
    for r in read_topic(bootstrap, TOPIC, idle_ms=1500):
        ends[r.partition] = max(ends.get(r.partition, 0), r.offset + 1)
    return ends


def test_dead_letters_of_a_reset_log_at_colliding_positions_are_all_kept(db, restartable_broker):
    """Malformed records of the new log land on the (partition, offset) positions malformed records
    of the old log hold: each is stored (keyed by the log's identity), and the DLQ topic gets the new
    log's records, not the old rows at those positions."""
    from app.core.db import session_scope
    from app.repositories.events import DeadLetterRow, insert_dead_letters
    from tests.fixtures.broker import read_topic

    bootstrap, restart = restartable_broker
    group = f"restart-{uuid.uuid4().hex[:8]}"
    old = [(b"same-key", b"old-not-json-%d" % i, []) for i in range(5)]
    new = [(b"same-key", b"new-not-json-%d" % i, []) for i in range(5)]  # same key: same partition, offsets 0-4
    produce(bootstrap, TOPIC, old)
    consumer, _ = _consumer(bootstrap, group)
    assert sum(consumer.run(idle_exit_s=3.0).dead_letters.values()) == len(old)

    restart()
    produce(bootstrap, TOPIC, new)
    consumer, _ = _consumer(bootstrap, group)
    assert sum(consumer.run(idle_exit_s=3.0).dead_letters.values()) == len(new)
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            'SELECT partition, "offset", log_id, raw FROM dead_letter ORDER BY log_id, "offset"'
        ).fetchall()
    assert len(rows) == len(old) + len(new) and len({r[2] for r in rows}) == 2 and None not in {r[2] for r in rows}
    positions = {(p, o) for p, o, _, _ in rows}
    assert len(positions) == len(new)  # every position collides
    assert {bytes(r[3]) for r in rows} == {v for _, v, _ in old + new}
    published = [r.value for r in read_topic(bootstrap, DLQ, idle_ms=1500)]  # the DLQ topic was re-created too
    assert sorted(published) == sorted(v for _, v, _ in new), published

    # insert_dead_letters reports what it inserted: a redelivery (same log and position) is not counted
    again = [DeadLetterRow(TOPIC, p, o, b"k", b"x", None, "decode", "", log_id=log) for p, o, log, _ in rows[:2]] + [
        DeadLetterRow(TOPIC, rows[0][0], rows[0][1], b"k", b"x", None, "decode", "", log_id="a-third-log")
    ]
    with session_scope() as s:
        assert insert_dead_letters(s, again) == 1

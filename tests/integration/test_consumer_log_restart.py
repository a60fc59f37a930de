"""A broker that comes back with an empty log while the group's offsets stay in Postgres (the local
stack after ``demo --down``; a topic re-created or a cluster restored in production): every event
produced afterwards is stored, and the reset is reported, never silent (real tansu, real Postgres)."""

from __future__ import annotations

import threading
import traceback
import uuid

import psycopg
import pytest

from consumers.testing import generate_stream, kafka_record, produce, scalar, wait_for

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
    assert len(errors) == 2 and all("past the log's end offset" in e and "re-reading" in e for e in errors)
    for p, stored in before.items():
        assert any(f"{TOPIC}:{p}: the stored next offset {stored} is past" in e for e in errors), errors
    assert _resets(reader) == {0: 1, 1: 1}


def test_a_consumer_running_across_the_restart_reads_the_new_log(db, restartable_broker):
    """The client's own position is past the new log's end: it falls back to the log's start, and
    the consumer sees records below the position it expected and checks the stored offsets."""
    bootstrap, restart = restartable_broker
    group = f"restart-{uuid.uuid4().hex[:8]}"
    first, second = generate_stream(400, seed=73), generate_stream(120, seed=74)
    produce(bootstrap, TOPIC, [kafka_record(e) for e in first])
    consumer, reader = _consumer(bootstrap, group, session_timeout_ms=6000)
    result: dict = {}

    def run() -> None:
        try:
            result["stats"] = consumer.run()
        except BaseException as exc:  # noqa: BLE001 -- reported by the assertions below
            result["error"] = "".join(traceback.format_exception(exc))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM event_log") == len(first), 60, what="first stream stored")
        restart()
        produce(bootstrap, TOPIC, [kafka_record(e) for e in second])
        wait_for(
            lambda: scalar(db, "SELECT count(*) FROM event_log") == len(first) + len(second),
            120,
            what="second stream stored",
        )
    finally:
        consumer.stop()
        t.join(60)
    assert "error" not in result, result["error"]
    assert sum(_stored_offsets(db, group).values()) == len(second)
    assert set(_resets(reader)) == {0, 1}


def test_offset_reset_fail_stops_the_consumer_and_reads_nothing(db, restartable_broker):
    from consumers.offsets import OffsetBeyondLogEnd

    bootstrap, restart = restartable_broker
    group = f"restart-{uuid.uuid4().hex[:8]}"
    first = generate_stream(200, seed=75)
    produce(bootstrap, TOPIC, [kafka_record(e) for e in first])
    consumer, _ = _consumer(bootstrap, group)
    consumer.run(idle_exit_s=3.0)
    before = _stored_offsets(db, group)
    restart()
    produce(bootstrap, TOPIC, [kafka_record(e) for e in generate_stream(40, seed=76)])
    consumer, reader = _consumer(bootstrap, group, offset_reset="fail")
    with pytest.raises(OffsetBeyondLogEnd) as err:
        consumer.run(idle_exit_s=3.0)
    assert any("past the log's end offset" in r for r in err.value.reasons)
    assert scalar(db, "SELECT count(*) FROM event_log") == len(first)
    assert _stored_offsets(db, group) == before
    assert set(_resets(reader)) == {0, 1}

"""The outbox relay against real Postgres and the real Kafka-protocol broker."""

from __future__ import annotations

import json
import os
import threading
import time

import pytest
from sqlalchemy import select, text

from app.lifecycle.messages import parse_lifecycle_message
from app.models import Outbox
from app.outbox.relay import OutboxRelay, pending_count
from serving.watcher import Deduper, message_identity
from tests.integration.test_api_support import base, lifecycle_topic, seed_checkpoint, seed_gate, store  # noqa: F401

pytestmark = pytest.mark.integration


def consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 20.0) -> list:
    """Every message on a one-partition topic, from the beginning, once ``expected`` arrived
    (plus a short grace period so extra copies would show up)."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, enable_auto_commit=False, group_id=None, auto_offset_reset="earliest"
    )
    tp = TopicPartition(topic, 0)
    consumer.assign([tp])
    consumer.seek_to_beginning(tp)
    out, deadline, grace = [], time.monotonic() + timeout_s, None
    try:
        while time.monotonic() < deadline:
            for msgs in consumer.poll(timeout_ms=300).values():
                out.extend(msgs)
            if len(out) >= expected:
                grace = grace or time.monotonic() + 1.0
                if time.monotonic() > grace:
                    break
        return out
    finally:
        consumer.close()


def _changes(session, store) -> list[str]:
    """A promotion then a rollback, committed (two outbox rows)."""
    from app.promotion.service import promote_checkpoint, rollback_production

    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, "ckpt-0001", "base", passed=True)
    promote_checkpoint(session, checkpoint_id="ckpt-0001", expected_production_id="base", actor="alice", reason="r")
    session.commit()
    rollback_production(session, expected_production_id="ckpt-0001", actor="alice", reason="r")
    session.commit()
    return ["checkpoint.promoted", "checkpoint.rolled_back"]


def test_relay_publishes_in_order_with_identity_headers(session, store, base, topics, lifecycle_topic, kafka_bootstrap):
    expected = _changes(session, store)
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 2
        assert relay.relay_pending() == 0
    assert pending_count() == 0
    msgs = consume_all(kafka_bootstrap, topics["lifecycle"], 2)
    assert [json.loads(m.value)["type"] for m in msgs] == expected
    rows = list(session.scalars(select(Outbox).order_by(Outbox.id)))
    for m, row in zip(msgs, rows):
        headers = dict(m.headers)
        assert headers["outbox-id"] == str(row.id).encode()
        assert headers["event-id"] == row.payload["event_id"].encode()
        assert headers["event-type"] == row.event_type.encode()
        assert m.key == row.key.encode()
        assert json.loads(m.value)["outbox_id"] == row.id


def test_relay_publishes_each_promotion_once_even_when_restarted_between_publish_and_mark(
    session, store, base, topics, lifecycle_topic, kafka_bootstrap
):
    expected = _changes(session, store)

    def crash(acked: list[int]) -> None:
        assert len(acked) == 2  # the broker acknowledged both ...
        raise RuntimeError("relay killed before marking")  # ... but the marks never commit

    with OutboxRelay(after_publish=crash) as doomed, pytest.raises(RuntimeError):
        doomed.relay_batch()
    assert pending_count() == 2
    with OutboxRelay() as restarted:
        assert restarted.relay_pending() == 2
    with OutboxRelay() as third:
        assert third.relay_pending() == 0

    msgs = consume_all(kafka_bootstrap, topics["lifecycle"], 4)
    raw = [json.loads(m.value) for m in msgs]
    assert [p["type"] for p in raw] == expected * 2  # at-least-once on the wire: the batch went out twice ...
    dedupe = Deduper()
    seen = [p for p, m in zip(raw, msgs) if dedupe.first_time(message_identity(parse_lifecycle_message(p), m.headers))]
    assert [p["type"] for p in seen] == expected  # ... exactly once to a consumer that dedupes
    assert len({p["event_id"] for p in seen}) == 2


def test_relay_is_single_flight(session, store, base, topics, lifecycle_topic, kafka_bootstrap, database_url):
    _changes(session, store)
    from app.core.db import get_engine
    from app.core.locks import AdvisoryLock

    held, release = threading.Event(), threading.Event()

    def hold_lock() -> None:
        with get_engine().begin() as conn:
            conn.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": AdvisoryLock.RELAY})
            held.set()
            release.wait(10)

    t = threading.Thread(target=hold_lock)
    t.start()
    try:
        assert held.wait(10)
        with OutboxRelay() as second:
            assert second.relay_batch() == 0  # another relay is publishing: do not overtake it
        assert pending_count() == 2
    finally:
        release.set()
        t.join(10)
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 2


def test_celery_task_runs_one_relay_pass(session, store, base, topics, lifecycle_topic, kafka_bootstrap):
    from app.outbox.tasks import relay_outbox

    _changes(session, store)
    assert relay_outbox.name == "flywheel.outbox.relay"
    assert relay_outbox.apply().get() == 2  # executed in-process, as a worker would
    assert pending_count() == 0
    assert relay_outbox.apply().get() == 0


def test_a_committed_change_wakes_the_relay_long_before_its_next_poll(
    session, store, base, topics, lifecycle_topic, kafka_bootstrap
):
    relay = OutboxRelay()
    worker = threading.Thread(target=relay.run_forever, kwargs={"interval_s": 60.0}, daemon=True)
    worker.start()
    try:
        time.sleep(2.0)  # the loop has made its first pass and listens
        committed = time.monotonic()
        expected = _changes(session, store)
        msgs = consume_all(kafka_bootstrap, topics["lifecycle"], 2, timeout_s=20.0)
        assert [json.loads(m.value)["type"] for m in msgs] == expected
        # A poll every 60 s would take up to a minute; the NOTIFY at commit takes well under 10 s.
        assert time.monotonic() - committed < 10.0
    finally:
        relay.stop()
        worker.join(70)
        relay.close()
    assert not worker.is_alive()


def test_a_relay_publishes_again_after_its_broker_restarted(session, store, base, db, tmp_path, monkeypatch):
    """A relay whose idempotent producer the broker forgot (tansu restarted on the same port: its
    producer ids lived in memory) publishes again: the failed batch closes the producer and the next
    one starts a new one. Kept, the producer would fail every later batch (the relay never recovers)."""
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from app.core.settings import get_settings
    from ops.broker import create_topics, start_broker

    port = free_port()
    broker = start_broker(tmp_path / "broker", port)
    bootstrap, topic = broker.bootstrap, "flywheel.lifecycle.restart"
    monkeypatch.setenv("FLYWHEEL_KAFKA_LIFECYCLE_TOPIC", topic)
    get_settings.cache_clear()
    try:
        create_topics(bootstrap, {topic: 1})
        with OutboxRelay(bootstrap, ack_timeout_s=10.0) as relay:
            _changes(session, store)
            assert relay.relay_pending() == 2
            stop_pid(broker.pid)
            broker = start_broker(tmp_path / "broker", port)
            create_topics(bootstrap, {topic: 1})
            from app.lifecycle.messages import CheckpointCreated
            from app.outbox.lifecycle import enqueue_lifecycle

            enqueue_lifecycle(session, CheckpointCreated(checkpoint_id="ckpt-0002", path=str(store.root)))
            session.commit()
            published, deadline = 0, time.monotonic() + 60
            while published == 0 and time.monotonic() < deadline:
                try:
                    published = relay.relay_pending()
                except Exception:  # noqa: BLE001 -- the first batch may meet the forgotten producer
                    time.sleep(1.0)
            assert published == 1
        assert [json.loads(m.value)["type"] for m in consume_all(bootstrap, topic, 1)] == ["checkpoint.created"]
    finally:
        stop_pid(broker.pid)


def test_a_batch_the_broker_does_not_acknowledge_in_time_closes_the_producer(
    session, store, base, db, tmp_path, monkeypatch
):
    """A broker that stops answering (SIGSTOPped: its sockets stay open, nothing comes back) makes
    the batch's flush time out: the relay raises ``InfrastructureError``, marks nothing and drops its
    producer, and once the broker answers again the next batch publishes on a new producer."""
    import signal

    from app.core.errors import InfrastructureError
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from app.core.settings import get_settings
    from ops.broker import create_topics, start_broker

    broker = start_broker(tmp_path / "broker", free_port())
    bootstrap, topic = broker.bootstrap, "flywheel.lifecycle.frozen"
    monkeypatch.setenv("FLYWHEEL_KAFKA_LIFECYCLE_TOPIC", topic)
    get_settings.cache_clear()
    try:
        create_topics(bootstrap, {topic: 1})
        with OutboxRelay(bootstrap, ack_timeout_s=3.0) as relay:
            _changes(session, store)
            assert relay.relay_pending() == 2
            from app.lifecycle.messages import CheckpointCreated
            from app.outbox.lifecycle import enqueue_lifecycle

            enqueue_lifecycle(session, CheckpointCreated(checkpoint_id="ckpt-0002", path=str(store.root)))
            session.commit()
            os.kill(broker.pid, signal.SIGSTOP)
            try:
                with pytest.raises(InfrastructureError, match="did not take outbox rows"):
                    relay.relay_pending()
                assert relay._producer is None and pending_count() == 1
            finally:
                os.kill(broker.pid, signal.SIGCONT)
            published, deadline = 0, time.monotonic() + 60
            while published == 0 and time.monotonic() < deadline:
                try:
                    published = relay.relay_pending()
                except InfrastructureError:
                    time.sleep(1.0)
            assert published == 1 and pending_count() == 0
    finally:
        stop_pid(broker.pid)

"""EventProducer against the real Kafka-protocol broker: headers and keys on the wire, and no event
lost or reordered across a broker outage or a producer restart."""

from __future__ import annotations

import time
from collections import defaultdict

import pytest

from producers.events import decode_event
from producers.events.types import EditAccepted, EditAcceptedEvent, ModelResponded, ModelRespondedEvent
from producers.producer import EventProducer

pytestmark = pytest.mark.integration


def _event(i: int, session: str) -> EditAcceptedEvent:
    return EditAcceptedEvent(session_id=session, user_id="u1", payload=EditAccepted(edit_id=f"e{i}"))


def consume_all(bootstrap: str, topic: str, expected: int, timeout_s: float = 30.0) -> list:
    """Every record of ``topic`` (all partitions, from the start), without a consumer group."""
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        deadline = time.monotonic() + timeout_s
        parts: set[int] = set()
        while not parts and time.monotonic() < deadline:  # empty when a metadata fetch timed out
            parts = consumer.partitions_for_topic(topic)
            if not parts:
                time.sleep(0.2)
        assert parts, f"topic {topic} has no partitions"
        consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
        out = []
        while len(out) < expected and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                out += batch
        # Nothing more should be there (exactly once): one more short poll.
        for batch in consumer.poll(timeout_ms=500).values():
            out += batch
        return out
    finally:
        consumer.close()


def _by_session(messages) -> dict[str, list[str]]:
    seen: dict[str, list[str]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.partition, m.offset)):
        ev = decode_event(m.value)
        seen[ev.session_id].append(getattr(ev.payload, "edit_id", ev.type))
    return seen


def test_produce_consume_round_trip_with_key_and_trace_headers(kafka_bootstrap, topics, tmp_path):
    from app.core.telemetry import configure_telemetry, tracer

    configure_telemetry("flywheel-test", exporter="none")
    topic = topics["interactions"]
    producer = EventProducer(spool_dir=tmp_path)  # bootstrap and topic from settings
    assert producer.topic == topic
    responded = ModelRespondedEvent(
        session_id="s-model",
        user_id="u1",
        payload=ModelResponded(
            request_id="r1",
            segment_index=0,
            turn_index=0,
            checkpoint_id="base",
            prompt_token_ids=[1, 2, 3],
            completion_token_ids=[7, 8],
            completion_logprobs=[-0.5, -0.25],
            latency_s=0.2,
        ),
    )
    with tracer("test").start_as_current_span("editor-request") as span:
        producer.emit(responded)
        for i in range(30):
            producer.emit(_event(i, session=f"s{i % 4}"))
    producer.close(timeout_s=30)
    assert producer.metrics["sent"] == 31 and producer.metrics["spooled"] == 0

    messages = consume_all(kafka_bootstrap, topic, 31)
    assert len(messages) == 31
    trace_id = format(span.get_span_context().trace_id, "032x")
    partitions: dict[bytes, set[int]] = defaultdict(set)
    for m in messages:
        ev = decode_event(m.value)
        headers = dict(m.headers)
        assert m.key == ev.session_id.encode()
        assert headers["event-type"] == ev.type.encode()
        assert headers["traceparent"].decode().split("-")[1] == trace_id
        partitions[m.key].add(m.partition)
    assert all(len(p) == 1 for p in partitions.values()), "a session maps to one partition"
    got = {decode_event(m.value).event_id: decode_event(m.value) for m in messages}
    decoded = got[responded.event_id]
    assert isinstance(decoded.seq, int)  # the SDK numbers each session's events (gap detection)
    assert decoded == responded.model_copy(update={"seq": decoded.seq}), "the event decodes to exactly what was emitted"
    assert _by_session(messages)["s1"] == [f"e{i}" for i in range(30) if i % 4 == 1]


def test_broker_outage_spools_then_delivers_every_event_once_in_order(tmp_path):
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from ops.broker import create_topics, start_broker

    topic, port = "editor.interactions.outage", free_port()
    broker = start_broker(tmp_path / "logs", port=port)
    create_topics(broker.bootstrap, {topic: 4})
    errors: list[Exception] = []
    producer = EventProducer(
        broker.bootstrap,
        topic,
        spool_dir=tmp_path / "spool",
        on_error=lambda exc, ev: errors.append(exc),
        delivery_timeout_s=2.0,
        connect_timeout_s=1.0,
        max_backoff_s=1.0,
    )
    try:
        for i in range(0, 40):
            producer.emit(_event(i, session=f"s{i % 5}"))
        producer.flush(timeout_s=30)
        assert producer.metrics["sent"] == 40
        assert len(consume_all(broker.bootstrap, topic, 40)) == 40
        stop_pid(broker.pid)  # tansu keeps messages in memory: the first 40 go with it

        for i in range(40, 140):
            producer.emit(_event(i, session=f"s{i % 5}"))
        producer.flush(timeout_s=30)
        m = producer.metrics
        assert m["broker_down"] == 1 and m["spool_pending"] == 100 and m["sent"] == 40, m
        assert errors

        broker = start_broker(tmp_path / "logs", port=port)  # same address, empty broker
        create_topics(broker.bootstrap, {topic: 4})
        for i in range(140, 160):  # emitted while the spool drains: must come after it
            producer.emit(_event(i, session=f"s{i % 5}"))
        producer.flush(timeout_s=60)
        m = producer.metrics
        assert m["sent"] == 160 and m["spool_pending"] == 0 and m["broker_down"] == 0, m
        producer.close(timeout_s=30)

        messages = consume_all(broker.bootstrap, topic, 120)
        ids = [decode_event(m.value).payload.edit_id for m in messages]
        assert sorted(ids) == sorted(f"e{i}" for i in range(40, 160)), "every event exactly once"
        for session, seen in _by_session(messages).items():
            k = int(session[1:])
            assert seen == [f"e{i}" for i in range(40, 160) if i % 5 == k], f"{session} out of order"
    finally:
        producer.close(timeout_s=5)
        stop_pid(broker.pid)


def test_spool_left_by_a_dead_producer_is_delivered_first(kafka_bootstrap, topics, tmp_path):
    from app.core.net import free_port

    topic = topics["interactions"]
    offline = EventProducer(
        f"127.0.0.1:{free_port()}", topic, spool_dir=tmp_path, connect_timeout_s=0.5, delivery_timeout_s=1.0
    )
    for i in range(10):
        offline.emit(_event(i, session="s"))
    offline.close(timeout_s=20)
    assert offline.metrics["spool_pending"] == 10

    online = EventProducer(kafka_bootstrap, topic, spool_dir=tmp_path)
    for i in range(10, 15):
        online.emit(_event(i, session="s"))
    online.close(timeout_s=30)
    assert online.metrics["sent"] == 15 and online.metrics["spool_pending"] == 0
    messages = consume_all(kafka_bootstrap, topic, 15)
    assert _by_session(messages)["s"] == [f"e{i}" for i in range(15)]

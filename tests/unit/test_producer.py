"""EventProducer without a broker: validation, metrics, spooling order, restarts, import weight."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from app.core.errors import InvalidEventError
from producers.events import decode_event
from producers.events.types import EditAccepted, EditAcceptedEvent, EventBase
from producers.producer import EventProducer
from producers.spool import Spool


def _event(i: int, session: str = "s1") -> EditAcceptedEvent:
    return EditAcceptedEvent(session_id=session, user_id="u1", payload=EditAccepted(edit_id=f"e{i}"))


@pytest.fixture
def dead_bootstrap() -> str:
    """An address where nothing listens: every connection is refused."""
    from app.core.net import free_port

    return f"127.0.0.1:{free_port()}"


@pytest.fixture
def producer_factory(tmp_path, dead_bootstrap):
    made: list[EventProducer] = []

    def make(**kw) -> EventProducer:
        kw.setdefault("spool_dir", tmp_path / "spool")
        kw.setdefault("connect_timeout_s", 0.5)
        kw.setdefault("delivery_timeout_s", 1.0)
        p = EventProducer(kw.pop("bootstrap", dead_bootstrap), "editor.interactions", **kw)
        made.append(p)
        return p

    yield make
    for p in made:
        p.close(timeout_s=5)


def _spooled(spool_dir) -> list:
    spool = Spool(spool_dir)
    out = []
    while True:
        records, token = spool.read(100)
        if not records:
            break
        out += records
        spool.commit(token)
    spool.close()
    return out


@pytest.mark.parametrize(
    ("event", "reason"),
    [
        ({"type": "no.such_event", "session_id": "s", "user_id": "u", "payload": {}}, "unknown_type"),
        ({"type": "edit.accepted", "session_id": "s", "user_id": "u", "payload": {}}, "validation"),
        ({"type": "edit.accepted", "session_id": "", "user_id": "u", "payload": {"edit_id": "e"}}, "validation"),
        (
            {
                "type": "edit.accepted",
                "schema_version": 99,
                "session_id": "s",
                "user_id": "u",
                "payload": {"edit_id": "e"},
            },
            "schema_version",
        ),
        (["not", "an", "object"], "not_object"),
    ],
)
def test_invalid_events_raise_value_error_and_are_counted(producer_factory, event, reason):
    producer = producer_factory()
    with pytest.raises(ValueError) as info:
        producer.emit(event)
    assert isinstance(info.value, InvalidEventError) and info.value.reason == reason
    assert producer.metrics["invalid"] == 1 and producer.metrics["emitted"] == 0


def test_oversized_and_abstract_events_are_rejected(producer_factory):
    producer = producer_factory(max_event_bytes=2048)
    big = EditAcceptedEvent(session_id="s", user_id="u", payload=EditAccepted(edit_id="e" * 128))
    from producers.events.types import FollowupSent, FollowupSentEvent

    with pytest.raises(ValueError, match="bytes"):
        producer.emit(FollowupSentEvent(session_id="s", user_id="u", payload=FollowupSent(text="x" * 4000)))
    with pytest.raises(ValueError):
        producer.emit(EventBase(type="edit.accepted", session_id="s", user_id="u"))
    producer.emit(big)  # under the limit
    assert producer.metrics["invalid"] == 2 and producer.metrics["emitted"] == 1


def test_broker_down_spools_in_order_reports_and_never_raises(producer_factory, tmp_path):
    errors: list[Exception] = []
    producer = producer_factory(on_error=lambda exc, ev: errors.append(exc))
    events = [_event(i, session=f"s{i % 3}") for i in range(50)]
    events.append({"type": "edit.accepted", "session_id": "s0", "user_id": "u1", "payload": {"edit_id": "e50"}})
    t0 = time.monotonic()
    for ev in events:
        producer.emit(ev)
    assert time.monotonic() - t0 < 0.5, "emit must not wait for the broker"
    producer.flush(timeout_s=20)
    m = producer.metrics
    assert m["emitted"] == 51 and m["sent"] == 0 and m["spooled"] == 51 and m["spool_pending"] == 51
    assert m["errors"] >= 1 and m["broker_down"] == 1 and m["buffered"] == 0
    assert errors and all(isinstance(e, Exception) for e in errors)
    producer.close()
    with pytest.raises(RuntimeError):
        producer.emit(_event(0))

    records = _spooled(tmp_path / "spool")
    assert [decode_event(r.value).payload.edit_id for r in records] == [f"e{i}" for i in range(51)]
    for r in records:
        ev = decode_event(r.value)
        assert r.key == ev.session_id.encode() and r.topic == "editor.interactions"
        assert ("event-type", b"edit.accepted") in r.headers


def test_full_buffer_overflows_to_the_spool_behind_buffered_events(producer_factory, tmp_path):
    # The sender is busy failing to connect for ~2 s: the first 3 events fill memory, the rest go
    # to the spool's tail; the fault then moves memory to the spool's head, so order is kept.
    producer = producer_factory(buffer_size=3, connect_timeout_s=2.0)
    time.sleep(0.2)
    for i in range(10):
        producer.emit(_event(i))
    producer.close(timeout_s=20)
    assert producer.metrics["spooled"] == 10
    assert [decode_event(r.value).payload.edit_id for r in _spooled(tmp_path / "spool")] == [f"e{i}" for i in range(10)]


def test_a_new_producer_picks_up_the_spool_of_a_closed_one(producer_factory, tmp_path):
    first = producer_factory()
    for i in range(5):
        first.emit(_event(i))
    first.close(timeout_s=20)
    second = producer_factory()
    assert second.metrics["spool_pending"] == 5
    second.emit(_event(5))
    second.close(timeout_s=20)
    assert [decode_event(r.value).payload.edit_id for r in _spooled(tmp_path / "spool")] == [f"e{i}" for i in range(6)]


def test_on_error_that_raises_does_not_stop_the_producer(producer_factory):
    def bad(exc, ev):
        raise RuntimeError("callback bug")

    producer = producer_factory(on_error=bad)
    producer.emit(_event(0))
    producer.flush(timeout_s=20)
    producer.emit(_event(1))
    producer.flush(timeout_s=20)
    assert producer.metrics["spool_pending"] == 2


def test_session_partitioner_agrees_with_kafka_default():
    from kafka.cluster import ClusterMetadata
    from kafka.partitioner import DefaultPartitioner

    from producers.client import SessionPartitioner

    class Cluster(ClusterMetadata):
        def topics(self, exclude_internal_topics=True):
            return {"t"}

        def partitions_for_topic(self, topic):
            return {0, 1, 2, 3, 4, 5}

        def available_partitions_for_topic(self, topic):
            return {0, 1, 2, 3, 4, 5}

    cluster, ours, theirs = Cluster(), SessionPartitioner(max_entries=10), DefaultPartitioner()
    for i in range(50):
        key = f"session-{i % 23}".encode()
        assert ours.partition("t", key, key, b"", b"", cluster) == theirs.partition("t", key, key, b"", b"", cluster)


def test_producer_module_imports_neither_torch_nor_sqlalchemy():
    code = (
        "import sys, producers.producer; "
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('torch', 'sqlalchemy', 'celery')); "
        "print(bad); sys.exit(1 if bad else 0)"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_a_failed_spool_write_drops_the_event_loudly_but_never_raises(producer_factory, monkeypatch):
    import errno

    reported = []
    producer = producer_factory(buffer_size=0, on_error=lambda exc, ev: reported.append((exc, ev)))

    def disk_full(records):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(producer._spool, "append", disk_full)
    event = _event(0)
    producer.emit(event)  # memory "full" (size 0) and the spool cannot be written
    m = producer.metrics
    assert m["dropped"] == 1 and m["emitted"] == 1 and m["spooled"] == 0
    assert reported and reported[0][1] is event and reported[0][0].errno == errno.ENOSPC


def test_a_spool_at_its_bound_drops_new_events_loudly_and_keeps_the_older_ones(producer_factory, tmp_path):
    from producers.spool import SpoolFullError, encode_record

    reported = []
    one = len(encode_record(_spooled_record(_event(0))))
    producer = producer_factory(
        buffer_size=0,
        spool_max_bytes=3 * one + one // 2,  # room for 3 of them
        on_error=lambda exc, ev: reported.append((exc, ev)),
    )
    events = [_event(i) for i in range(5)]
    for ev in events:
        producer.emit(ev)  # broker down, memory "full" (size 0): straight to the spool
    m = producer.metrics
    assert (m["emitted"], m["spooled"], m["dropped"]) == (5, 3, 2)
    assert m["spool_pending"] == 3 and abs(m["spool_pending_bytes"] - 3 * one) < 30  # an occurred_at may be shorter
    assert [ev for _, ev in reported] == events[3:] and all(isinstance(e, SpoolFullError) for e, _ in reported)
    producer.close(timeout_s=10)
    assert [decode_event(r.value).payload.edit_id for r in _spooled(tmp_path / "spool")] == ["e0", "e1", "e2"]


def _spooled_record(event: EventBase):
    """The spool record ``emit`` writes for ``event``."""
    from app.core.telemetry import inject_headers
    from producers.events import encode_event
    from producers.spool import Record

    headers = inject_headers([("event-type", event.type.encode())])
    return Record("editor.interactions", event.session_id.encode(), headers, encode_event(event))

"""The serving watcher reads the lifecycle topic through the one typed parse
(``app.lifecycle.messages.parse_lifecycle_message``): on the real broker, records that are not JSON,
of an unknown type, or a production change without the fields its type needs are logged with
the reason and skipped, and the valid promotion behind them (written by ``app.lifecycle``
through the outbox and relay) still moves serving."""

from __future__ import annotations

import json
import logging

import pytest
from kafka import KafkaProducer

from app.lifecycle.changes import promote_checkpoint
from app.outbox.relay import OutboxRelay
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import (  # noqa: F401
    base,
    lifecycle_topic,
    seed_checkpoint,
    seed_gate,
    store,
)
from tests.unit.test_api_units import RecordingEngine

pytestmark = pytest.mark.integration


def test_the_watcher_skips_what_it_cannot_parse_and_follows_the_typed_promotion(
    session, store, base, lifecycle_topic, kafka_bootstrap, tmp_path, monkeypatch, caplog
):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    bad = [
        b"{not json",
        json.dumps({"type": "checkpoint.exploded", "event_id": "e1", "checkpoint_id": "x", "occurred_at": "now"}),
        json.dumps({"type": "checkpoint.promoted", "checkpoint_id": "ckpt-0001"}),  # no event_id: not deduplicable
    ]
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    try:
        for value in bad:
            producer.send(lifecycle_topic, value if isinstance(value, bytes) else value.encode(), key=b"x")
        producer.flush(timeout=30)
    finally:
        producer.close()
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, "ckpt-0001", "base", passed=True)
    promote_checkpoint(session, checkpoint_id="ckpt-0001", expected_production_id="base", actor="alice", reason="r")
    session.commit()
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 1

    engine = RecordingEngine("base")
    watcher = ServingWatcher(engine, store=store)
    try:
        with caplog.at_level(logging.WARNING, logger="flywheel.watcher"):
            for _ in range(40):
                watcher.poll_once(timeout_ms=250)
                if engine.calls:
                    break
    finally:
        watcher.stop()
    assert engine.calls == [("full", "ckpt-0001")]
    skipped = [r.getMessage() for r in caplog.records if "skipping lifecycle message" in r.getMessage()]
    assert len(skipped) == 3, skipped
    assert "not JSON" in skipped[0]
    assert "unknown lifecycle message type 'checkpoint.exploded'" in skipped[1]
    assert "checkpoint.promoted without event_id, occurred_at" in skipped[2]

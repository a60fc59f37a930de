"""Serving follows production end to end: HTTP promotion -> outbox -> relay -> broker -> watcher ->
engine moved (a full load) -> serving.json -> GET /v1/production reports it."""

from __future__ import annotations

import pytest

from app.outbox.relay import OutboxRelay
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import (  # noqa: F401
    auth,
    base,
    client,
    lifecycle_topic,
    make_token,
    seed_checkpoint,
    seed_gate,
    store,
)
from tests.unit.test_api_units import RecordingEngine

pytestmark = pytest.mark.integration


def _poll_until_moved(watcher: ServingWatcher, engine: RecordingEngine, calls: int, timeout_polls: int = 40) -> None:
    for _ in range(timeout_polls):
        watcher.poll_once(timeout_ms=250)
        if len(engine.calls) >= calls:
            return
    raise AssertionError(f"engine did not move: {engine.calls}")


def test_serving_follows_promotions_and_rollbacks(
    client, session, store, base, lifecycle_topic, kafka_bootstrap, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))  # serving.json lands here; the API reads it here
    rm = auth(make_token(session, "release_manager", name="alice"))
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, "ckpt-0001", "base", passed=True)
    seed_checkpoint(session, store, "ckpt-0002", parent_id="ckpt-0001", generation=2)

    def promote(cid: str, expected: str) -> None:
        r = client.post(
            "/v1/promotions",
            headers=rm,
            json={"checkpoint_id": cid, "reason": "gate passed", "expected_production_id": expected},
        )
        assert r.status_code == 201, r.text

    promote("ckpt-0001", "base")
    seed_gate(session, "ckpt-0002", "ckpt-0001", passed=True)
    promote("ckpt-0002", "ckpt-0001")
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 2

    engine = RecordingEngine("base")
    watcher = ServingWatcher(engine, store=store)
    try:
        _poll_until_moved(watcher, engine, 1)
        # Both promotions arrived in one batch: straight to ckpt-0002.
        assert engine.calls == [("full", "ckpt-0002")]
        prod = client.get("/v1/production", headers=rm).json()
        assert prod["checkpoint"]["id"] == prod["serving_checkpoint_id"] == "ckpt-0002" and prod["serving_in_sync"]

        r = client.post(
            "/v1/rollbacks", headers=rm, json={"reason": "p99 latency", "expected_production_id": "ckpt-0002"}
        )
        assert r.status_code == 201
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1
        _poll_until_moved(watcher, engine, 2)
        assert engine.calls[-1] == ("full", "ckpt-0001")
        assert client.get("/v1/production", headers=rm).json()["serving_checkpoint_id"] == "ckpt-0001"
    finally:
        watcher.stop()

    # A restarted watcher resumes from its saved positions: nothing is applied twice.
    again = ServingWatcher(engine, store=store)
    try:
        for _ in range(4):
            again.poll_once(timeout_ms=250)
        assert len(engine.calls) == 2
    finally:
        again.stop()
    # A watcher without saved state replays the topic but only acts on the newest change.
    fresh_home = tmp_path / "replica-2"
    replica = RecordingEngine("base")
    other = ServingWatcher(replica, store=store, home=fresh_home)
    try:
        other.run(idle_exit=True)  # `flywheel watch --once`: read to the end of the topic, then return
        assert replica.calls == [("full", "ckpt-0001")]  # the newest change: the rollback
    finally:
        other.stop()


def test_serving_rides_out_broker_and_inference_server_outages_and_then_follows_the_promotion(
    client, session, store, base, relayed_broker, tmp_path, monkeypatch
):
    """The broker goes away while the watcher follows production (every connection dropped, new ones
    refused), and the inference server is restarting when the promotion made meanwhile arrives (its
    first two loads fail as ``OpenAICompatibleEngine`` reports an unreachable server): the watcher keeps
    running, serving keeps its model, and it moves once both answer, without skipping the change."""
    import threading
    import time

    from app.core.errors import InfrastructureError
    from app.core.settings import get_settings
    from consumers.testing import wait_for
    from ops.broker import create_topics

    class RestartingServer(RecordingEngine):
        failures = 2

        def load_checkpoint(self, checkpoint_id, path) -> None:
            if self.failures:
                self.failures -= 1
                raise InfrastructureError("inference server unreachable at http://127.0.0.1:8000: connection refused")
            super().load_checkpoint(checkpoint_id, path)

    topic = "flywheel.lifecycle.outage"
    create_topics(relayed_broker.bootstrap, {topic: 1})
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", relayed_broker.bootstrap)
    monkeypatch.setenv("FLYWHEEL_KAFKA_LIFECYCLE_TOPIC", topic)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    get_settings.cache_clear()
    rm = auth(make_token(session, "release_manager", name="alice"))
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, "ckpt-0001", "base", passed=True)

    engine = RestartingServer("base")
    watcher = ServingWatcher(engine, store=store)
    errors: list[BaseException] = []

    def run() -> None:
        try:
            watcher.run(poll_ms=250)
        except BaseException as exc:  # noqa: BLE001 -- asserted below
            errors.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    try:
        wait_for(lambda: watcher.topic_follower.connected, 30, what="the watcher to connect")
        time.sleep(1.0)
        relayed_broker.relay.cut()
        time.sleep(5.0)
        assert thread.is_alive() and not errors, errors
        r = client.post(
            "/v1/promotions",
            headers=rm,
            json={"checkpoint_id": "ckpt-0001", "reason": "gate passed", "expected_production_id": "base"},
        )
        assert r.status_code == 201, r.text  # the promotion commits; its outbox message waits
        relayed_broker.relay.mend()
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1
        wait_for(lambda: engine.calls or errors, 90, what="serving to move")
        assert engine.calls == [("full", "ckpt-0001")] and engine.failures == 0 and not errors, errors
        assert thread.is_alive()
    finally:
        watcher.stop()
    thread.join(60)  # a poll in flight may take kafka-python's request timeout to give up after the outage
    assert not thread.is_alive()


def test_serving_follows_a_promotion_published_after_its_broker_restarted_empty(
    session, store, base, db, tmp_path, monkeypatch
):
    """The broker restarts on its port with an empty log (tansu keeps messages in memory) while the
    watcher has read past where the new log will be: a promotion published there is still applied
    (the watcher sees its position beyond the log's end and reads the new log from its start), and
    nothing it applied before is applied again."""
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from app.core.settings import get_settings
    from app.lifecycle.messages import CheckpointCreated
    from app.outbox.lifecycle import enqueue_lifecycle
    from app.promotion.service import promote_checkpoint
    from ops.broker import create_topics, start_broker

    port, topic = free_port(), "flywheel.lifecycle.restarted"
    broker = start_broker(tmp_path / "broker", port)
    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", broker.bootstrap)
    monkeypatch.setenv("FLYWHEEL_KAFKA_LIFECYCLE_TOPIC", topic)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    get_settings.cache_clear()
    watcher = None
    try:
        create_topics(broker.bootstrap, {topic: 1})
        for cid, parent, generation in (("ckpt-0001", "base", 1), ("ckpt-0002", "ckpt-0001", 2)):
            seed_checkpoint(session, store, cid, parent_id=parent, generation=generation)
            seed_gate(session, cid, parent, passed=True)
        promote_checkpoint(session, checkpoint_id="ckpt-0001", expected_production_id="base", actor="a", reason="r")
        for i in range(5):  # the old log grows past where the new one will be
            enqueue_lifecycle(session, CheckpointCreated(checkpoint_id=f"other-{i}", path=str(store.root)))
        session.commit()
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 6
        engine = RecordingEngine("base")
        watcher = ServingWatcher(engine, store=store)
        _poll_until_moved(watcher, engine, 1)
        for _ in range(4):
            watcher.poll_once(timeout_ms=250)  # read to the end of the old log
        assert engine.calls == [("full", "ckpt-0001")]

        stop_pid(broker.pid)
        broker = start_broker(tmp_path / "broker", port)
        create_topics(broker.bootstrap, {topic: 1})
        promote_checkpoint(
            session, checkpoint_id="ckpt-0002", expected_production_id="ckpt-0001", actor="a", reason="r"
        )
        session.commit()
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1
        _poll_until_moved(watcher, engine, 2)
        assert engine.calls == [("full", "ckpt-0001"), ("full", "ckpt-0002")]
    finally:
        if watcher is not None:
            watcher.stop()
        stop_pid(broker.pid)

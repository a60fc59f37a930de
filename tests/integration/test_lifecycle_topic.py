"""The lifecycle-topic follower the watcher and the front share, on the real broker: every partition
is read, a record that is not a lifecycle message is skipped with its offset consumed, a batch
whose handler raises is read again (positions advance only once it returned), and a new follower
given the positions resumes after them."""

from __future__ import annotations

import uuid

import pytest
from kafka import KafkaProducer

from app.lifecycle.messages import ProductionChanged
from ops.broker import create_topics
from serving.lifecycle_topic import LifecycleBatch, LifecycleTopicFollower

pytestmark = pytest.mark.integration


def _follower(bootstrap: str, topic: str, handle, **kw) -> LifecycleTopicFollower:
    return LifecycleTopicFollower(
        handle, bootstrap=bootstrap, topic=topic, client_id="test-follower", start_at="beginning", **kw
    )


def _poll_until(follower: LifecycleTopicFollower, done, polls: int = 40) -> None:
    for _ in range(polls):
        follower.poll_once(timeout_ms=250)
        if done():
            return
    raise AssertionError("the follower did not read what was published")


def test_the_follower_reads_every_partition_skips_junk_and_rereads_a_failed_batch(kafka_bootstrap):
    topic = f"lifecycle-follower-{uuid.uuid4().hex[:8]}"
    create_topics(kafka_bootstrap, {topic: 2})
    producer = KafkaProducer(bootstrap_servers=kafka_bootstrap)
    for partition, checkpoint in ((0, "ckpt-a"), (1, "ckpt-b")):
        message = ProductionChanged(type="checkpoint.promoted", checkpoint_id=checkpoint)
        producer.send(topic, message.model_dump_json().encode(), partition=partition)
    producer.send(topic, b"not json", partition=0)
    producer.flush()
    producer.close()

    batches: list[LifecycleBatch] = []
    failures = [RuntimeError("the engine is restarting")]

    def handle(batch: LifecycleBatch) -> None:
        if failures:
            raise failures.pop()
        batches.append(batch)

    follower = _follower(kafka_bootstrap, topic, handle)
    try:
        with pytest.raises(RuntimeError):  # the first batch fails: its positions stay where they were
            _poll_until(follower, lambda: False)
        assert follower.positions == {0: 0, 1: 0}
        _poll_until(follower, lambda: {0: 2, 1: 1} == follower.positions)
        seen = {r.message.checkpoint_id for b in batches for r in b.records}
        assert seen == {"ckpt-a", "ckpt-b"}  # both partitions; the junk record skipped, its offset consumed
        assert all(r.message.type == "checkpoint.promoted" for b in batches for r in b.records)
    finally:
        follower.stop()

    again: list[LifecycleBatch] = []
    resumed = _follower(kafka_bootstrap, topic, again.append, positions=follower.positions)
    try:
        for _ in range(4):
            resumed.poll_once(timeout_ms=250)
        assert again == [] and resumed.caught_up()  # resumed after what was applied: nothing twice
    finally:
        resumed.stop()


def test_a_log_recreated_past_the_old_position_is_read_from_its_start(tmp_path):
    """A broker restarted with an empty log (tansu keeps it in memory) whose new log grew past the
    position the follower read the old one to before the follower polled again: offsets alone would
    resume mid-log and skip the new log's first change; the topic's new identity makes the follower
    read every partition from offset 0."""
    from app.core.net import free_port
    from app.core.pids import stop_pid
    from ops.broker import start_broker

    topic, port = "lifecycle-recreated", free_port()
    broker = start_broker(tmp_path / "broker", port)
    bootstrap = broker.bootstrap

    def publish(*checkpoints: str) -> None:
        producer = KafkaProducer(bootstrap_servers=bootstrap)
        for checkpoint in checkpoints:
            message = ProductionChanged(type="checkpoint.promoted", checkpoint_id=checkpoint)
            producer.send(topic, message.model_dump_json().encode(), partition=0)
        producer.flush()
        producer.close()

    seen: list[str] = []
    follower = _follower(bootstrap, topic, lambda b: seen.extend(r.message.checkpoint_id for r in b.records))
    try:
        create_topics(bootstrap, {topic: 1})
        publish("old")
        _poll_until(follower, lambda: seen == ["old"])
        assert follower.positions == {0: 1}

        stop_pid(broker.pid)
        broker = start_broker(tmp_path / "broker", port)
        create_topics(bootstrap, {topic: 1})
        publish("first", "second", "third")  # the new log ends at 3, past the old position 1
        _poll_until(follower, lambda: "third" in seen)
        assert seen == ["old", "first", "second", "third"]  # nothing of the new log skipped
        assert follower.positions[0] == 3
    finally:
        follower.stop()
        stop_pid(broker.pid)

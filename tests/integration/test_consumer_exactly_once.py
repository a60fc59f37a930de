"""Exactly-once effect under crashes: consumers killed with SIGKILL mid-stream, and a Postgres
restart mid-stream, lose nothing and duplicate nothing (real tansu broker, real Postgres).

Size: over 400 lines because every fault (a SIGKILL, a database or broker outage, a consumer started
before either) runs on the same stream, process and read-back helpers at the top; one test a fault."""

from __future__ import annotations

import os
import random
import signal
import threading
import time
import traceback
import uuid
from pathlib import Path

import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from app.core.db import normalize_url
from app.core.migrate import upgrade
from consumers.replay import compare_projections, dump_projection
from consumers.testing import (
    consumer_process,
    generate_stream,
    kafka_record,
    produce,
    scalar,
    traceparent_for,
    wait_for,
)
from tests.fixtures.broker import Relay, read_topic

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test: the session's broker keeps every group's membership, and a group
    whose members were SIGKILLed by an earlier test must not slow this test's join."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


# Columns stamped by the ingestion clock or by seq interleaving across partitions: equal within one
# database (replay), not across two runs.
RUN_DEPENDENT = {"trajectory": {"finalized_at", "window_closes_at", "max_event_seq"}, "reward_label": {"created_at"}}


def _dump(url: str, exclude=None):
    engine = create_engine(normalize_url(url))
    try:
        with Session(engine) as s, s.begin():
            return dump_projection(s, exclude=exclude)
    finally:
        engine.dispose()


def _stop(procs) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    for p in procs:
        try:
            p.wait(timeout=20)
        except Exception:  # noqa: BLE001
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def _produce_slowly(bootstrap: str, topic: str, records, chunks: int, pause_s: float) -> threading.Thread:
    def run() -> None:
        step = -(-len(records) // chunks)
        for i in range(0, len(records), step):
            produce(bootstrap, topic, records[i : i + step])
            time.sleep(pause_s)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _event_ids(url: str) -> list[uuid.UUID]:
    with psycopg.connect(url) as conn:
        return [r[0] for r in conn.execute("SELECT event_id FROM event_log")]


def _each_event_once(url: str, n: int) -> list[uuid.UUID]:
    """``event_log``'s event ids, after checking there are ``n`` of them, none twice."""
    ids = _event_ids(url)
    assert len(ids) == len(set(ids)) == n
    return ids


def test_sigkilled_consumers_leave_every_event_once_and_the_same_trajectories(
    db, topics, kafka_bootstrap, pg_admin_url, tmp_path
):
    events = generate_stream(20_000, seed=7, concurrency=32)
    records = [kafka_record(e) for e in events]
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": db}
    logs = tmp_path / "consumer.log"
    producer = _produce_slowly(kafka_bootstrap, topics["interactions"], records, chunks=20, pause_s=0.4)
    procs = [consumer_process(env, log_path=logs) for _ in range(2)]
    rng, kills = random.Random(11), 0
    try:
        while producer.is_alive() or kills < 4:
            time.sleep(rng.uniform(0.8, 2.5))
            i = rng.randrange(len(procs))
            os.killpg(procs[i].pid, signal.SIGKILL)  # at a random point: mid-batch, mid-commit, mid-join
            procs[i].wait()
            procs[i] = consumer_process(env, log_path=logs)
            kills += 1
        producer.join()
        wait_for(lambda: scalar(db, "SELECT count(*) FROM event_log") == len(events), 240, what="all events stored")
    finally:
        _stop(procs)
    ids = _each_event_once(db, len(events))
    assert set(ids) == {e.event_id for e in events}
    stored_offsets = scalar(
        db, "SELECT sum(next_offset) FROM consumer_offset WHERE topic = %s", (topics["interactions"],)
    )
    assert stored_offsets == len(events)
    assert "Traceback" not in logs.read_text(errors="replace")

    # The same stream, uninterrupted, into a second database.
    name = f"flywheel_test_{uuid.uuid4().hex[:10]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    other = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url=other)
        proc = consumer_process(
            {**env, "FLYWHEEL_DATABASE_URL": other}, group=f"uninterrupted-{uuid.uuid4().hex[:6]}", log_path=logs
        )
        try:
            wait_for(
                lambda: scalar(other, "SELECT count(*) FROM event_log") == len(events),
                180,
                what="uninterrupted run stored all events",
            )
        finally:
            _stop([proc])
        killed, clean = _dump(db, RUN_DEPENDENT), _dump(other, RUN_DEPENDENT)
        assert len(clean["trajectory"]) > 500 and len(clean["reward_label"]) > 300
        assert compare_projections(clean, killed) == []
    finally:
        with psycopg.connect(pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def test_a_database_restart_mid_stream_loses_nothing(topics, kafka_bootstrap, tmp_path):
    from app.core.net import free_port
    from ops.postgres import start_postgres, stop_postgres

    datadir, port = tmp_path / "pgdata", free_port()
    server = start_postgres(datadir, port=port)
    url = server.url
    try:
        upgrade(url=url)
        events = generate_stream(6_000, seed=8)
        records = [kafka_record(e) for e in events]
        env = {**os.environ, "FLYWHEEL_DATABASE_URL": url}
        logs = tmp_path / "consumer.log"
        proc = consumer_process(env, log_path=logs)
        try:
            producer = _produce_slowly(kafka_bootstrap, topics["interactions"], records, chunks=12, pause_s=0.5)
            wait_for(lambda: scalar(url, "SELECT count(*) FROM event_log") > 0, 60, what="first batch stored")
            stop_postgres(datadir)  # mid-stream: the consumer must retry, not crash or dead-letter
            time.sleep(3)
            assert proc.poll() is None
            start_postgres(datadir, port=port)
            producer.join()
            wait_for(
                lambda: scalar(url, "SELECT count(*) FROM event_log") == len(events),
                180,
                what="all events stored after the restart",
            )
        finally:
            _stop([proc])
        _each_event_once(url, len(events))
        assert scalar(url, "SELECT count(*) FROM dead_letter") == 0
        text = Path(logs).read_text(errors="replace")
        assert "retrying" in text  # it did see the outage
    finally:
        stop_postgres(datadir)


@pytest.mark.parametrize("method", ["copy", "copy_upsert", "unnest"])
def test_every_insert_method_stores_a_batch_once_and_skips_duplicates(db, method):
    """The batch transaction without Kafka: producer duplicates (same event_id at a new offset) and
    a redelivered batch (same offsets) are no-ops under each ``append_events`` method."""
    from app.core.db import session_scope
    from consumers.batch import apply_batch
    from consumers.classify import Message, classify
    from consumers.ingest import projector_from_settings

    events = generate_stream(600, seed=14)
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(events)]
    dupes = [Message("t", 0, len(msgs) + i, *kafka_record(e)) for i, e in enumerate(events[::7])]
    batch = [classify(m, 1 << 20) for m in msgs + dupes]
    projector = projector_from_settings()
    with session_scope() as s:
        first = apply_batch(s, "g", batch[:400], projector, method)
        second = apply_batch(s, "g", batch[400:], projector, method)
    with session_scope() as s:  # the same records again, as after a crash before the Kafka commit
        again = apply_batch(s, "g", batch, projector, method)
    assert first.stored + second.stored == len(events) and second.duplicates == len(dupes)
    assert again.stale == len(batch) and again.stored == 0
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT event_id) FROM event_log").fetchone() == (
            len(events),
            len(events),
        )
        seqs = [r[0] for r in conn.execute('SELECT seq FROM event_log ORDER BY "offset"')]
        assert seqs == sorted(seqs)  # seq follows the partition order
        ids = [i for (a,) in conn.execute("SELECT event_ids FROM trajectory") for i in a]
        assert len(ids) == len(set(ids)) == len(events)
        assert conn.execute("SELECT next_offset FROM consumer_offset WHERE group_id = 'g'").fetchone() == (len(batch),)
        traced = conn.execute("SELECT session_id, trace_id, span_id FROM event_log").fetchall()
        assert all(f"00-{t}-{sp}-01".encode() == traceparent_for(sid) for sid, t, sp in traced)  # the producer span


def test_offsets_the_broker_no_longer_had_are_reported_as_lost(db, kafka_bootstrap, caplog):
    """A partition whose next records start past the group's stored offset (retention deleted the
    ones between before they were consumed: the client resets to the earliest it has): the batch is
    stored and the offsets move on, and the loss is reported (an ERROR line naming the range, the
    ``offsets_skipped`` counter), never silent. A new group's first batch is not a gap."""
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.classify import Message
    from consumers.ingest import IngestConsumer
    from consumers.telemetry import ConsumerMetrics

    events = generate_stream(200, seed=21)
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(events)]
    consumer, reader = IngestConsumer(bootstrap=kafka_bootstrap, topic="t"), InMemoryMetricReader()
    consumer.metrics = ConsumerMetrics("t", consumer.group_id, MeterProvider(metric_readers=[reader]).get_meter("t"))
    try:
        assert consumer.process(msgs[10:60]).offset_gaps == {}  # a new group starts where its first batch does
        with caplog.at_level("ERROR", logger="consumers.ingest"):
            out = consumer.process(msgs[90:150])
            assert consumer.process(msgs[150:]).offset_gaps == {}
    finally:
        consumer.close()
    assert out.offset_gaps == {("t", 0): (60, 90)} and out.stored == 60
    assert [r.getMessage() for r in caplog.records if "offsets" in r.getMessage()] == [
        "t:0: offsets 60..89 (30 records) were gone from the broker when this group read on (retention deleted "
        "them before they were consumed): their events are not in event_log"
    ]
    (skipped,) = [
        m
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "flywheel.consumer.offsets_skipped"
    ]
    assert [(p.attributes["partition"], p.value) for p in skipped.data.data_points] == [(0, 30)]
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == 50 + len(msgs) - 90
        assert conn.execute("SELECT next_offset FROM consumer_offset WHERE topic = 't'").fetchone()[0] == len(msgs)


def test_seq_values_are_reserved_in_blocks_and_never_overlap(db):
    """``event_log.seq`` comes from whole blocks of the sequence (its increment): one ``nextval`` per
    1024 events, values unique and increasing from one reservation to the next; a sequence still
    incrementing by 1 (before migration 0007) gives consecutive values."""
    from app.repositories.events import _reserve_seqs

    with psycopg.connect(db) as conn, conn.cursor() as cur:
        a, b, c = _reserve_seqs(cur, 2500), _reserve_seqs(cur, 3), _reserve_seqs(cur, 1024)
        assert (len(a), len(b), len(c)) == (2500, 3, 1024)
        both = a + b + c
        assert both == sorted(both) and len(set(both)) == len(both)
        cur.execute("SELECT last_value FROM event_log_seq_seq")
        assert cur.fetchone()[0] == c[0]  # 3 + 1 + 1 blocks, c took the last one whole
        cur.execute(f"ALTER SEQUENCE event_log_seq_seq INCREMENT BY 1 RESTART WITH {c[-1] + 1}")
        assert _reserve_seqs(cur, 5) == list(range(c[-1] + 1, c[-1] + 6))
        conn.rollback()


def test_a_consumer_started_before_the_broker_retries_until_it_answers(db, topics, kafka_bootstrap):
    """The broker is not reachable when the consumer starts (a deploy, a broker restart): the start is
    retried with backoff instead of crashing the process; once the broker answers, the consumer
    ingests everything. Stopped while retrying, it returns at once, having consumed nothing."""
    from app.core.net import free_port
    from consumers.ingest import IngestConsumer
    from consumers.settings import get_consumer_settings

    events = generate_stream(300, seed=44)
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events])
    port = free_port()
    settings = get_consumer_settings().model_copy(update={"bootstrap_timeout_ms": 300, "retry_max_wait_s": 0.5})

    def start(consumer, out: dict) -> threading.Thread:
        t = threading.Thread(target=lambda: out.update(stats=consumer.run(idle_exit_s=2.0)), daemon=True)
        t.start()
        return t

    stopped: dict = {}
    consumer = IngestConsumer(bootstrap=f"127.0.0.1:{port}", group_id=f"late-{uuid.uuid4().hex[:8]}", settings=settings)
    t = start(consumer, stopped)
    time.sleep(2.0)  # several failed starts
    assert t.is_alive()
    consumer.stop()
    t.join(10)
    assert not t.is_alive() and stopped["stats"].stored == 0

    result: dict = {}
    t = start(
        IngestConsumer(bootstrap=f"127.0.0.1:{port}", group_id=f"late-{uuid.uuid4().hex[:8]}", settings=settings),
        result,
    )
    time.sleep(2.0)
    assert t.is_alive() and not result  # still retrying, not crashed
    relay = Relay(port, kafka_bootstrap)
    threading.Thread(target=relay.serve_forever, daemon=True).start()
    try:
        t.join(120)
    finally:
        relay.shutdown()
        relay.server_close()
    assert not t.is_alive() and result["stats"].stored == len(events)
    _each_event_once(db, len(events))


def test_a_broker_outage_mid_stream_loses_nothing_and_the_consumer_rides_it_out(db, relayed_broker):
    """The broker becomes unreachable while the consumer ingests (every connection dropped, new ones
    refused) for longer than the group's session timeout, then comes back: the consumer keeps
    running (fetches, heartbeats and Kafka commits fail meanwhile; polls raise), reconnects, and every
    event ends up in ``event_log`` exactly once, every dead letter in ``dead_letter`` and on the DLQ
    topic once."""
    from consumers.ingest import IngestConsumer
    from consumers.settings import get_consumer_settings
    from ops.broker import create_topics

    bootstrap, relay = relayed_broker.bootstrap, relayed_broker.relay
    topic, dlq, consumer = "interactions", "interactions.dlq", None
    try:
        create_topics(bootstrap, {topic: 4, dlq: 1})
        events = generate_stream(3000, seed=45)
        records = [kafka_record(e) for e in events]
        produce(bootstrap, topic, records[:1500] + [(b"k", b"{not json 1", [])])
        settings = get_consumer_settings().model_copy(
            update={"batch_max_records": 200, "retry_max_wait_s": 1.0, "session_timeout_ms": 6000}
        )
        consumer = IngestConsumer(
            bootstrap=bootstrap,
            topic=topic,
            group_id=f"outage-{uuid.uuid4().hex[:8]}",
            dlq_topic=dlq,
            settings=settings,
        )
        result: dict = {}

        def run() -> None:
            try:
                result["stats"] = consumer.run(idle_exit_s=15.0)
            except BaseException as exc:  # noqa: BLE001 -- the assertions below report it
                result["error"] = "".join(traceback.format_exception(exc))

        t = threading.Thread(target=run, daemon=True)
        t.start()
        assert wait_for(lambda: scalar(db, "SELECT count(*) FROM event_log") > 0, 60)
        relay.cut()
        time.sleep(10)  # past the 6 s session timeout
        assert t.is_alive(), result.get("error")
        relay.mend()
        produce(bootstrap, topic, records[1500:] + [(b"k", b"{not json 2", [])])
        t.join(180)
        assert not t.is_alive() and "error" not in result, result.get("error")
        _each_event_once(db, len(events))
        assert scalar(db, "SELECT count(*) FROM dead_letter") == 2
        assert sorted(m.value for m in read_topic(bootstrap, dlq)) == [b"{not json 1", b"{not json 2"]
    finally:
        if consumer is not None:
            consumer.stop()


def test_a_consumer_started_while_the_database_is_down_stays_in_its_group_and_ingests_once_it_is_up(
    topics, kafka_bootstrap, tmp_path
):
    """Postgres is down when the consumer joins its group: the stored offsets cannot be read in the
    rebalance callback, which blocks the client's heartbeats. Rather than retrying there until the
    session expires (and rejoining, again and again, through the outage), the member pauses the
    partitions and keeps heartbeating; when Postgres is back it seeks them and ingests every event once."""
    from app.core.net import free_port
    from ops.postgres import start_postgres, stop_postgres

    datadir, port = tmp_path / "pgdata", free_port()
    url = start_postgres(datadir, port=port).url
    try:
        upgrade(url=url)
        events = generate_stream(1_500, seed=45)
        produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events])
        stop_postgres(datadir)
        logs = tmp_path / "consumer.log"
        proc = consumer_process({**os.environ, "FLYWHEEL_DATABASE_URL": url}, log_path=logs)
        try:
            wait_for(lambda: "paused" in logs.read_text(errors="replace"), 90, what="partitions paused")
            time.sleep(8)  # longer than the session timeout (6 s)
            assert proc.poll() is None
            start_postgres(datadir, port=port)
            wait_for(
                lambda: scalar(url, "SELECT count(*) FROM event_log") == len(events),
                120,
                what="all events stored once Postgres is up",
            )
        finally:
            _stop([proc])
        _each_event_once(url, len(events))
        text = logs.read_text(errors="replace")
        assert "Heartbeat session expired" not in text, text[-3000:]
        assert text.count("partitions assigned") == 1  # it never had to rejoin
    finally:
        stop_postgres(datadir)

"""Observability of the ingest consumer: one span per batch linked to the producers' trace contexts,
and metrics for events by outcome, dead letters by reason, finalized trajectories, lag and rate."""

from __future__ import annotations

import uuid

import pytest
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import InMemoryMetricReader
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from consumers.telemetry import ConsumerMetrics, producer_links
from consumers.testing import generate_stream, kafka_record, produce, traceparent_for

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test: the session's broker keeps every group's membership, and a group
    whose members were SIGKILLed by an earlier test must not slow this test's join."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


def test_producer_links_parse_w3c_traceparent_and_skip_garbage():
    good = traceparent_for("s-1")
    links = producer_links(
        [
            [("traceparent", good)],
            [("traceparent", good)],
            [("traceparent", b"00-zz")],
            [("traceparent", b"00-" + b"0" * 32 + b"-" + b"0" * 16 + b"-01")],
            [],
        ],
        limit=10,
    )
    assert len(links) == 1  # duplicates collapse, malformed and all-zero (invalid) contexts are dropped
    assert format(links[0].context.trace_id, "032x") == good.decode().split("-")[1]
    assert links[0].context.is_remote


def test_batch_spans_link_producer_traces_and_metrics_are_recorded(db, topics, kafka_bootstrap):
    from consumers.ingest import IngestConsumer

    events = generate_stream(400, seed=12)
    records = [kafka_record(e) for e in events] + [(b"k", b"not json", [])] * 3
    produce(kafka_bootstrap, topics["interactions"], records)

    exporter, reader = InMemorySpanExporter(), InMemoryMetricReader()
    tracer_provider = TracerProvider()
    tracer_provider.add_span_processor(SimpleSpanProcessor(exporter))
    consumer = IngestConsumer()
    consumer._tracer = tracer_provider.get_tracer("test")
    consumer.metrics = ConsumerMetrics(
        consumer.topic, consumer.group_id, MeterProvider(metric_readers=[reader]).get_meter("test")
    )
    stats = consumer.run(idle_exit_s=1.5)

    spans = [s for s in exporter.get_finished_spans() if s.name == "consumers.ingest.batch"]
    assert len(spans) == stats.batches >= 1
    linked = {format(link.context.trace_id, "032x") for s in spans for link in s.links}
    assert linked == {traceparent_for(e.session_id).decode().split("-")[1] for e in events}
    assert sum(s.attributes["messaging.batch.message_count"] for s in spans) == len(records)

    points = {}
    for rm in reader.get_metrics_data().resource_metrics:
        for sm in rm.scope_metrics:
            for metric in sm.metrics:
                points[metric.name] = list(metric.data.data_points)
    by_outcome = {p.attributes["outcome"]: p.value for p in points["flywheel.consumer.events"]}
    assert by_outcome["stored"] == len(events) and by_outcome["dead_letter"] == 3
    assert [(p.attributes["reason"], p.value) for p in points["flywheel.consumer.dead_letters"]] == [("bad_json", 3)]
    assert sum(p.value for p in points["flywheel.consumer.trajectories_finalized"]) == stats.finalized["signals"] > 0
    assert {p.attributes["partition"] for p in points["flywheel.consumer.lag"]} == {0, 1, 2, 3}
    assert all(p.value == 0 for p in points["flywheel.consumer.lag"])  # caught up
    assert "flywheel.consumer.events_per_second" in points and "flywheel.consumer.batch_duration" in points


def test_a_stuck_group_join_is_abandoned_for_a_fresh_client(monkeypatch):
    from consumers.ingest import IngestConsumer

    monkeypatch.setenv("FLYWHEEL_KAFKA_BOOTSTRAP", "127.0.0.1:1")  # never contacted here
    consumer = IngestConsumer()
    closed = []

    class Stuck:
        def close(self, autocommit):
            closed.append(autocommit)

    client = consumer.client
    client.consumer = Stuck()
    monkeypatch.setattr(client, "new_consumer", lambda: "fresh client")
    client.joining_since = 100.0
    client.rejoin_if_stuck(100.0 + 14.0)  # < 3 x max_poll_interval (5 s): a join may take that long
    assert client.consumer.__class__ is Stuck and closed == []
    client.rejoin_if_stuck(100.0 + 31.0)
    assert client.consumer == "fresh client" and closed == [False]  # left without committing
    client.joining_since = None  # joined: nothing to watch
    client.rejoin_if_stuck(10_000.0)
    assert client.consumer == "fresh client"

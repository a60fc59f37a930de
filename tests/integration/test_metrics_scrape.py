"""Prometheus metrics after real work: a ``flywheel consume`` process stores a stream (and
dead-letters a malformed record), and its ``FLYWHEEL_METRICS_PORT`` serves the documented series
with non-zero values; the API serves ``/metrics`` without a token."""

from __future__ import annotations

import os
import signal
import uuid

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from app.core.net import free_port
from consumers.testing import consumer_process, generate_stream, kafka_record, produce, scalar, wait_for
from tests.integration.test_api_support import live_server  # noqa: F401

pytestmark = pytest.mark.integration


def samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels without the OTel scope labels) -> value."""
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            labels = tuple(sorted((k, v) for k, v in s.labels.items() if not k.startswith("otel_scope")))
            out[(s.name, labels)] = s.value
    return out


def total(found: dict, name: str, **labels: str) -> float:
    """Sum of the samples named ``name`` whose labels include ``labels``."""
    return sum(v for (n, ls), v in found.items() if n == name and set(labels.items()) <= set(ls))


def test_the_consumer_serves_its_series_after_storing_a_batch(db, topics, kafka_bootstrap, tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")
    events = generate_stream(300, seed=3)
    records = [kafka_record(e) for e in events] + [(b"s-bad", b"{not json", [])]
    produce(kafka_bootstrap, topics["interactions"], records)
    port = free_port()
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": db, "FLYWHEEL_METRICS_PORT": str(port)}
    proc = consumer_process(env, log_path=tmp_path / "consumer.log")
    try:
        wait_for(lambda: scalar(db, "SELECT count(*) FROM event_log") == len(events), 120, what="events stored")
        wait_for(lambda: scalar(db, "SELECT count(*) FROM dead_letter") == 1, 60, what="the dead letter")

        def scraped():
            try:
                found = samples(httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=5).text)
            except httpx.HTTPError:
                return None
            stored = total(found, "flywheel_consumer_events_total", outcome="stored")
            return found if stored == len(events) else None

        found = wait_for(scraped, 30, what="the stored events counted on /metrics")
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=30)
    assert total(found, "flywheel_consumer_dead_letters_total", reason="bad_json") == 1
    assert total(found, "flywheel_consumer_events_total", outcome="dead_letter") == 1
    assert total(found, "flywheel_consumer_batch_duration_seconds_count") > 0
    assert total(found, "flywheel_consumer_trajectories_finalized_total") > 0
    lag = [v for (n, _), v in found.items() if n == "flywheel_consumer_lag"]
    assert lag and all(v >= 0 for v in lag), "one lag gauge per partition"
    assert total(found, "target_info", service_name="flywheel-consumer") == 1


def test_the_api_serves_metrics_without_a_token(live_server):  # noqa: F811
    res = httpx.get(live_server + "/metrics", timeout=10)
    assert res.status_code == 200 and res.headers["content-type"].startswith("text/plain")
    found = samples(res.text)
    assert total(found, "target_info", service_name="flywheel-api") == 1 or any(
        n.startswith("python_") for n, _ in found
    )

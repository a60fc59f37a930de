"""W3C trace context through Kafka headers, and the producer's OpenTelemetry counters."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from opentelemetry import trace

from app.core.telemetry import configure_telemetry, extract_context, inject_headers, tracer


def test_trace_context_round_trips_through_kafka_headers():
    configure_telemetry("flywheel-test", exporter="none")
    with tracer("test").start_as_current_span("request") as span:
        headers = inject_headers([("event-type", b"model.responded")])
    sent = span.get_span_context()
    assert headers[0] == ("event-type", b"model.responded"), "existing headers are kept, first"
    names = [k for k, _ in headers]
    assert "traceparent" in names
    traceparent = dict(headers)["traceparent"].decode()
    assert traceparent.split("-")[1] == format(sent.trace_id, "032x")

    received = trace.get_current_span(extract_context(headers)).get_span_context()
    assert received.trace_id == sent.trace_id and received.span_id == sent.span_id
    assert received.is_remote

    # A consumer span started under the extracted context joins the producer's trace.
    with tracer("test").start_as_current_span("consume", context=extract_context(headers)) as child:
        assert child.get_span_context().trace_id == sent.trace_id


def test_no_active_span_injects_nothing_and_extracts_an_empty_context():
    headers = inject_headers([("event-type", b"x")])
    assert [k for k, _ in headers] == ["event-type"]
    assert not trace.get_current_span(extract_context(headers)).get_span_context().is_valid
    assert not trace.get_current_span(extract_context(None)).get_span_context().is_valid


def test_producer_exports_opentelemetry_counters(tmp_path):
    # A meter provider can be installed once per process: check in a fresh interpreter.
    code = textwrap.dedent(f"""
        from opentelemetry import metrics
        from opentelemetry.sdk.metrics import MeterProvider
        from opentelemetry.sdk.metrics.export import InMemoryMetricReader
        reader = InMemoryMetricReader()
        metrics.set_meter_provider(MeterProvider(metric_readers=[reader]))
        from app.core.net import free_port
        from producers.producer import EventProducer
        from producers.events.types import EditAccepted, EditAcceptedEvent
        p = EventProducer(f"127.0.0.1:{{free_port()}}", "t", spool_dir=__import__("pathlib").Path({str(tmp_path)!r}),
                          connect_timeout_s=0.5)
        for i in range(3):
            p.emit(EditAcceptedEvent(session_id="s", user_id="u", payload=EditAccepted(edit_id=str(i))))
        p.close(timeout_s=10)
        got = {{}}
        for rm in reader.get_metrics_data().resource_metrics:
            for sm in rm.scope_metrics:
                for m in sm.metrics:
                    if m.name == "flywheel.producer.events":
                        for dp in m.data.data_points:
                            got[dp.attributes["outcome"]] = dp.value
        print(got)
        assert got["emitted"] == 3 and got["spooled"] == 3 and got["errors"] >= 1, got
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr[-3000:]

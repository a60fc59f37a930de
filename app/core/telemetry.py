"""OpenTelemetry: one tracer/meter provider per process, W3C trace context in Kafka headers, and
span references stored with the loop's records.

``configure_telemetry`` is idempotent per process (saleor's celeryconf habit): Celery workers call it
from ``worker_process_init``, CLIs at start. Kafka headers are kafka-python's
``list[tuple[str, bytes]]``.

The loop's stages run in different processes and at different times, so each is its own trace;
they are joined by span links. A stage stores its span's W3C ``traceparent`` (:func:`span_reference`)
in the record it writes (checkpoint manifest ``trace``, eval run summary ``trace``, gate decision
report ``trace``; a lifecycle message carries the promotion's context in its headers), and the
stage that reads the record links to it (:func:`link_references`): promotion -> gate decision ->
eval runs -> training cycle -> the producer spans of the events it trained on (``event_log`` keeps
each event's producer trace and span id; ``trainer.trace_links``); serving's reload span is a child
of the promotion's context.
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Iterable
from typing import ParamSpec, TypeVar

from opentelemetry import metrics, trace
from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricReader, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter
from opentelemetry.trace import SpanContext, TraceFlags

from app.core.logs import RepeatThrottle, configure_service_logging, throttle_library_logs
from app.core.metrics import prometheus_reader, serve_metrics
from app.core.settings import get_settings
from producers.telemetry import KafkaHeaders, extract_context, inject_headers, meter

P = ParamSpec("P")
R = TypeVar("R")

__all__ = [
    "KafkaHeaders",
    "RepeatThrottle",
    "configure_service_logging",
    "throttle_library_logs",
    "configure_telemetry",
    "extract_context",
    "inject_headers",
    "link_references",
    "meter",
    "span_reference",
    "shutdown_telemetry",
    "tracer",
    "traced",
]


_lock = threading.Lock()
_configured: str | None = None


def configure_telemetry(service_name: str, exporter: str | None = None, *, metrics_port: bool = False) -> None:
    """Install tracer and meter providers for this process (once; later calls are no-ops). Metrics
    are always readable by Prometheus (``app.core.metrics``), and pushed too with ``otlp``.

    Args:
        service_name: ``service.name`` resource attribute (e.g. ``flywheel-consumer``).
        exporter: ``none`` | ``console`` | ``otlp``; default from ``FLYWHEEL_TELEMETRY_EXPORTER``.
        metrics_port: a long-lived process without HTTP: serve ``/metrics`` on
            ``FLYWHEEL_METRICS_PORT`` when it is set.
    """
    global _configured
    with _lock:
        if _configured is not None:
            return

        settings = get_settings().telemetry
        kind = exporter or settings.exporter
        resource = Resource.create({"service.name": service_name})
        tracer_provider = TracerProvider(resource=resource)
        readers: list[MetricReader] = [prometheus_reader()]
        if kind == "console":
            tracer_provider.add_span_processor(BatchSpanProcessor(ConsoleSpanExporter()))
        elif kind == "otlp":
            base = settings.otlp_endpoint.rstrip("/")
            tracer_provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=f"{base}/v1/traces")))
            readers.append(PeriodicExportingMetricReader(OTLPMetricExporter(endpoint=f"{base}/v1/metrics")))
        trace.set_tracer_provider(tracer_provider)
        metrics.set_meter_provider(MeterProvider(resource=resource, metric_readers=readers))
        _configured = service_name
        if metrics_port:
            serve_metrics()


def shutdown_telemetry() -> None:
    """Flush spans (console exporter output appears on stdout)."""
    provider = trace.get_tracer_provider()
    if hasattr(provider, "force_flush"):
        provider.force_flush()


def tracer(name: str) -> trace.Tracer:
    """A tracer for a flywheel module."""
    return trace.get_tracer(name)


def span_reference(span: trace.Span | None = None) -> str | None:
    """The W3C ``traceparent`` (``00-<trace id>-<span id>-<flags>``) of ``span`` (default: the
    current span), for a record to store; None when there is no valid span (telemetry off)."""
    ctx = (span or trace.get_current_span()).get_span_context()
    if not ctx.is_valid:
        return None
    return f"00-{ctx.trace_id:032x}-{ctx.span_id:016x}-{int(ctx.trace_flags):02x}"


def parse_reference(reference: object) -> SpanContext | None:
    """The remote span context of a stored ``traceparent``; None when absent or malformed."""
    if not isinstance(reference, str):
        return None
    parts = reference.split("-")
    if len(parts) != 4 or (len(parts[1]), len(parts[2]), len(parts[3])) != (32, 16, 2):
        return None
    try:
        ctx = SpanContext(
            int(parts[1], 16), int(parts[2], 16), is_remote=True, trace_flags=TraceFlags(int(parts[3], 16))
        )
    except ValueError:
        return None
    return ctx if ctx.is_valid else None


def link_references(references: Iterable[tuple[object, dict[str, str]]], span: trace.Span | None = None) -> int:
    """Link ``span`` (default: the current span) to each stored ``(traceparent, attributes)``;
    malformed or missing references are skipped. Returns how many links were added."""
    span = span or trace.get_current_span()
    added = 0
    for reference, attributes in references:
        ctx = parse_reference(reference)
        if ctx is not None:
            span.add_link(ctx, attributes)
            added += 1
    return added


def traced(span_name: str, *, attrs: tuple[str, ...] = ()) -> Callable[[Callable[P, R]], Callable[P, R]]:
    """Decorator: run the function in a span named ``span_name`` whose attributes
    ``flywheel.<arg>`` are the named arguments' values (bound by signature; str-converted), so a
    training cycle, eval run or promotion is linked to the checkpoints it touched. The decorated
    function keeps its signature for type checkers."""

    def wrap(fn: Callable[P, R]) -> Callable[P, R]:
        sig = inspect.signature(fn)

        @functools.wraps(fn)
        def inner(*args: P.args, **kwargs: P.kwargs) -> R:
            bound = sig.bind_partial(*args, **kwargs)
            attributes = {
                f"flywheel.{a}": str(getattr(bound.arguments[a], "name", bound.arguments[a]))
                for a in attrs
                if bound.arguments.get(a) is not None
            }
            with tracer(fn.__module__).start_as_current_span(span_name, attributes=attributes):
                return fn(*args, **kwargs)

        return inner

    return wrap

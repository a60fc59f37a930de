"""W3C trace context in Kafka headers (kafka-python's ``list[tuple[str, bytes]]``) and the meters
the producer SDK counts with. Only the OpenTelemetry API: the process that embeds the SDK chooses
the providers and exporters (the service's are set by :mod:`app.core.telemetry`)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from opentelemetry import metrics, propagate
from opentelemetry.context import Context
from opentelemetry.propagators.textmap import Getter, Setter

KafkaHeaders = list[tuple[str, bytes]]


class _HeaderSetter(Setter[KafkaHeaders]):
    def set(self, carrier: KafkaHeaders, key: str, value: str) -> None:
        carrier.append((key, value.encode()))


class _HeaderGetter(Getter[Sequence[tuple[str, bytes]]]):
    def get(self, carrier: Sequence[tuple[str, bytes]], key: str) -> list[str] | None:
        vals = [v.decode("utf-8", "replace") for k, v in carrier or () if k == key and v is not None]
        return vals or None

    def keys(self, carrier: Sequence[tuple[str, bytes]]) -> list[str]:
        return [k for k, _ in carrier or ()]


def inject_headers(headers: KafkaHeaders | None = None, context: Context | None = None) -> KafkaHeaders:
    """Append the current (or given) trace context as W3C ``traceparent``/``tracestate`` headers."""
    headers = list(headers or [])
    propagate.inject(headers, context=context, setter=_HeaderSetter())
    return headers


def extract_context(headers: Iterable[tuple[str, bytes]] | None) -> Context:
    """The trace context carried by Kafka headers (empty context when none)."""
    return propagate.extract(list(headers or ()), getter=_HeaderGetter())


def meter(name: str) -> metrics.Meter:
    """A meter for a flywheel module."""
    return metrics.get_meter(name)

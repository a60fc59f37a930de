"""Prometheus exposition of each process's OpenTelemetry metrics, and the loop's instruments that
belong to no single module.

Invariant: every process that configures telemetry (``app.core.telemetry.configure_telemetry``)
registers one :class:`PrometheusMetricReader` on ``prometheus_client``'s default registry, so what
its OpenTelemetry instruments record is scrapeable: the API at ``/metrics``, the long-lived processes
without HTTP (consumer, relay, watcher, Celery worker) on ``FLYWHEEL_METRICS_PORT`` when it is set.
OpenTelemetry names map to Prometheus names by the exporter's rules: dots become underscores,
counters end in ``_total``, a unit of seconds appends ``_seconds`` (docs/operations.md, "Metrics",
lists each series and its labels).
"""

from __future__ import annotations

import logging

from opentelemetry.exporter.prometheus import PrometheusMetricReader
from prometheus_client import CONTENT_TYPE_LATEST, REGISTRY, generate_latest, start_http_server

from app.core.settings import MetricsSettings
from producers.telemetry import meter

log = logging.getLogger(__name__)

_trainer, _evals, _serving = meter("flywheel.trainer"), meter("flywheel.evals"), meter("flywheel.serving")

CYCLE_DURATION = _trainer.create_histogram(
    "flywheel.trainer.cycle_duration",
    unit="s",
    description="seconds per training cycle, by how it ended (succeeded | skipped | failed | locked)",
)
GATE_DECISIONS = _evals.create_counter(
    "flywheel.gate.decisions", unit="{decision}", description="gate decisions recorded, by decision (pass | fail | ...)"
)
SERVING_RELOAD_DURATION = _serving.create_histogram(
    "flywheel.serving.reload_duration",
    unit="s",
    description="seconds the serving watcher took to move production's weights, by method (full | noop)",
)
SANDBOX_DENIALS = _serving.create_counter(
    "flywheel.sandbox.denials",
    unit="{run}",
    description="sandboxed commands stopped by a limit, by reason (timeout | cpu_time | file_size | memory | signal:N)",
)


def prometheus_reader() -> PrometheusMetricReader:
    """A metric reader that registers this process's metrics on ``prometheus_client``'s default
    registry (call once per process: a second one would register the same series twice)."""
    return PrometheusMetricReader()


def serve_metrics(settings: MetricsSettings | None = None) -> int | None:
    """Serve ``/metrics`` on ``FLYWHEEL_METRICS_HOST:FLYWHEEL_METRICS_PORT`` in a daemon thread, for
    a process without its own HTTP server. Returns the port, or None when no port is configured or
    it is taken (logged as an error: metrics are lost, the service is not)."""
    settings = settings or MetricsSettings.load()
    if settings.port is None:
        return None
    try:
        start_http_server(settings.port, addr=settings.host)
    except OSError as exc:
        log.error("metrics not served on %s:%s: %s", settings.host, settings.port, exc)
        return None
    log.info("metrics on http://%s:%s/metrics", settings.host, settings.port)
    return settings.port


def render_metrics() -> tuple[bytes, str]:
    """This process's metrics in the Prometheus text format, and its content type."""
    return generate_latest(REGISTRY), CONTENT_TYPE_LATEST

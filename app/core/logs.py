"""Process logging: plain text on a terminal, one JSON object per line elsewhere, with the trace and
span id of the OpenTelemetry span active where a line was written, so a log search joins a trace.

Invariant: a service configures the root logger once (:func:`configure_service_logging`), and only
when nothing else did (a host application's or a test runner's configuration wins). The format is
``FLYWHEEL_LOG_FORMAT`` (``text``, ``json``, or ``auto``: text when stderr is a terminal, JSON
otherwise); every record passes :class:`SpanContextFilter`, so ``trace_id`` and ``span_id`` are
on each JSON line written inside a span (W3C hex, as the trace exporter and ``event_log`` store them).
"""

from __future__ import annotations

import logging
import sys
import threading
import time
from collections.abc import Callable
from typing import TextIO

from opentelemetry import trace
from pythonjsonlogger.json import JsonFormatter

from app.core.settings import LogSettings

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# The JSON line's fields, in order; trace_id/span_id are null outside a span.
JSON_FIELDS = ("timestamp", "levelname", "name", "message", "service", "trace_id", "span_id")


class SpanContextFilter(logging.Filter):
    """Puts the current span's ``trace_id`` (32 hex digits) and ``span_id`` (16) on every record,
    None where no valid span is active, and the process's ``service`` name. Never drops a record."""

    def __init__(self, service: str | None = None) -> None:
        super().__init__()
        self.service = service

    def filter(self, record: logging.LogRecord) -> bool:
        ctx = trace.get_current_span().get_span_context()
        record.trace_id = f"{ctx.trace_id:032x}" if ctx.is_valid else None
        record.span_id = f"{ctx.span_id:016x}" if ctx.is_valid else None
        record.service = self.service
        return True


def json_formatter() -> logging.Formatter:
    """One JSON object per record: ``timestamp`` (ISO 8601, UTC), ``level``, ``logger``, ``message``,
    ``service``, ``trace_id``, ``span_id``, and any ``extra=`` fields; ``exc_info`` as text."""
    return JsonFormatter(
        list(JSON_FIELDS[1:]),
        timestamp=True,
        rename_fields={"levelname": "level", "name": "logger"},
    )


def use_json(settings: LogSettings, stream: TextIO | None = None) -> bool:
    """Whether to write JSON lines: ``json``, or ``auto`` on a stream that is not a terminal."""
    if settings.format == "auto":
        stream = stream or sys.stderr
        return not (hasattr(stream, "isatty") and stream.isatty())
    return settings.format == "json"


class RepeatThrottle(logging.Filter):
    """A handler filter that lets each distinct message of loggers under ``prefix`` through at most
    once per ``every_s`` seconds (distinct: same logger, level and format string), telling how many
    it held back. For libraries that log every failed attempt: kafka-python logs ~10 ERROR lines a
    second while its broker is away, which would bury the lines that matter. Other loggers pass.

    Args:
        prefix: logger-name prefix it applies to (``"kafka"`` covers ``kafka.cluster`` ...).
        every_s: seconds between two lines of the same message.
        clock: monotonic seconds (injectable for tests).
    """

    def __init__(self, prefix: str = "kafka", every_s: float = 30.0, clock: Callable[[], float] | None = None) -> None:
        super().__init__()

        self.prefix, self.every_s, self.clock = prefix, every_s, clock or time.monotonic
        self._last: dict[tuple[str, int, str], tuple[float, int]] = {}  # key -> (when let through, held back since)
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        if not (record.name == self.prefix or record.name.startswith(self.prefix + ".")):
            return True
        key, now = (record.name, record.levelno, str(record.msg)), self.clock()
        with self._lock:
            last = self._last.get(key)
            if last is not None and now - last[0] < self.every_s:
                self._last[key] = (last[0], last[1] + 1)
                return False
            held = last[1] if last is not None else 0
            self._last[key] = (now, 0)
            if len(self._last) > 10_000:  # messages with ids in their format string: do not grow forever
                self._last.clear()
        if held and last is not None:
            record.msg = f"{record.msg} [{held} more like this in the last {now - last[0]:.0f}s]"
        return True


def throttle_library_logs(prefix: str = "kafka", every_s: float = 30.0) -> RepeatThrottle:
    """Add a :class:`RepeatThrottle` to every handler of the root logger (call after configuring it)."""
    throttle = RepeatThrottle(prefix, every_s)
    for handler in logging.getLogger().handlers:
        handler.addFilter(throttle)
    return throttle


def configure_service_logging(level: int | str | None = None, service: str | None = None) -> None:
    """Logging for a long-running service command (``consume``, ``relay``, ``watch``, ``api``): records at
    ``level`` (default ``FLYWHEEL_LOG_LEVEL``) and above to stderr, as text or JSON lines (see the
    module invariant) with the span's ids; Alembic, httpx and kafka-python at WARNING, and each
    repeated kafka-python message at most once per 30 s (:class:`RepeatThrottle`: it logs every
    failed attempt while the broker is away). Does nothing to a root logger that already has
    handlers (a host application's or a test runner's configuration wins)."""
    root = logging.getLogger()
    if root.handlers:
        return
    settings = LogSettings.load()
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(json_formatter() if use_json(settings, sys.stderr) else logging.Formatter(TEXT_FORMAT))
    handler.addFilter(SpanContextFilter(service))
    root.addHandler(handler)
    root.setLevel(level if level is not None else settings.level)
    logging.getLogger("kafka").setLevel(logging.WARNING)
    logging.getLogger("alembic").setLevel(logging.WARNING)  # its set-up lines when a service checks the schema
    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request: every health check of a server
    throttle_library_logs("kafka", every_s=30.0)
    logging.captureWarnings(True)  # a library's warning is a line in the same format (py.warnings)

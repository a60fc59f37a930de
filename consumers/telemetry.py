"""Consumer metrics and span links (OpenTelemetry through ``app.core.telemetry``).

Instruments (all prefixed ``flywheel.consumer.``):

- ``events`` counter {outcome: stored | duplicate | stale | dead_letter | privacy_dropped | erased_dropped}
- ``dead_letters`` counter {reason}
- ``offsets_skipped`` counter {partition}: offsets retention deleted before the group read them (events lost)
- ``offset_resets`` counter {partition}: stored offsets found past the end of their partition's log (the log
  was re-created), each reset to the log's start (or the consumer stopped, with ``offset_reset = fail``)
- ``trajectories_finalized`` counter {by: signals | window | abandoned}
- ``batch_duration`` histogram (seconds)
- ``lag`` observable gauge {partition}: broker high-water mark minus the next offset to apply (messages)
- ``events_per_second`` observable gauge: records applied per second over the last ~10 s window
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Iterable, Mapping
from typing import Any

from opentelemetry.metrics import CallbackOptions, Meter, Observation
from opentelemetry.trace import Link, SpanContext, TraceFlags

from app.core.telemetry import meter


class ConsumerMetrics:
    """The ingest consumer's instruments; ``record_*`` methods are cheap and thread-safe."""

    def __init__(self, topic: str, group_id: str, meter_: Meter | None = None) -> None:
        m = meter_ or meter("flywheel.consumers")
        self._attrs = {"topic": topic, "group": group_id}
        self.events = m.create_counter(
            "flywheel.consumer.events", unit="{event}", description="records handled, by outcome"
        )
        self.dead_letters = m.create_counter(
            "flywheel.consumer.dead_letters", unit="{event}", description="dead-lettered records, by reason"
        )
        self.finalized = m.create_counter(
            "flywheel.consumer.trajectories_finalized",
            unit="{trajectory}",
            description="trajectories finalized, by trigger",
        )
        self.offsets_skipped = m.create_counter(
            "flywheel.consumer.offsets_skipped",
            unit="{message}",
            description="offsets the broker no longer had when the group read on (retention): events lost",
        )
        self.offset_resets = m.create_counter(
            "flywheel.consumer.offset_resets",
            unit="{partition}",
            description="stored offsets found past their partition's log end (a re-created log)",
        )
        self.batch_duration = m.create_histogram(
            "flywheel.consumer.batch_duration", unit="s", description="seconds per batch transaction"
        )
        self._lock = threading.Lock()
        self._lag: dict[int, int] = {}
        self._window: deque[tuple[float, int]] = deque()
        m.create_observable_gauge(
            "flywheel.consumer.lag",
            callbacks=[self._observe_lag],
            unit="{message}",
            description="high-water mark minus next offset, per partition",
        )
        m.create_observable_gauge(
            "flywheel.consumer.events_per_second",
            callbacks=[self._observe_rate],
            unit="{event}/s",
            description="records applied per second (10 s window)",
        )

    def record_batch(self, outcome: Any, seconds: float) -> None:
        """Count one applied batch (a ``consumers.counts.BatchOutcome``)."""
        a = self._attrs
        for name, n in (
            ("stored", outcome.stored),
            ("duplicate", outcome.duplicates),
            ("stale", outcome.stale),
            ("dead_letter", sum(outcome.dead_letters.values())),
            ("privacy_dropped", outcome.privacy_dropped),
            ("erased_dropped", outcome.erased_dropped),
        ):
            if n:
                self.events.add(n, {**a, "outcome": name})
        for reason, n in outcome.dead_letters.items():
            self.dead_letters.add(n, {**a, "reason": reason})
        for (_, partition), (stored, first) in outcome.offset_gaps.items():
            self.offsets_skipped.add(first - stored, {**a, "partition": partition})
        self.record_finalized(outcome.finalized)
        self.batch_duration.record(seconds, a)
        with self._lock:
            now = time.monotonic()
            self._window.append((now, outcome.messages))
            while self._window and now - self._window[0][0] > 10.0:
                self._window.popleft()

    def record_offset_reset(self, partition: int) -> None:
        """Count one stored offset found past its partition's log end."""
        self.offset_resets.add(1, {**self._attrs, "partition": partition})

    def record_finalized(self, by_kind: Mapping[str, int]) -> None:
        """Count finalizations (``{by: n}``)."""
        for by, n in by_kind.items():
            if n:
                self.finalized.add(n, {**self._attrs, "by": by})

    def set_lag(self, lag: dict[int, int]) -> None:
        """Replace the per-partition lag snapshot."""
        with self._lock:
            self._lag = dict(lag)

    def rate(self) -> float:
        """Records per second over the window."""
        with self._lock:
            if len(self._window) < 2:
                return 0.0
            span = self._window[-1][0] - self._window[0][0]
            return sum(n for _, n in list(self._window)[1:]) / span if span > 0 else 0.0

    def _observe_lag(self, _options: CallbackOptions) -> list[Observation]:
        with self._lock:
            lag = dict(self._lag)
        return [Observation(v, {**self._attrs, "partition": p}) for p, v in lag.items()]

    def _observe_rate(self, _options: CallbackOptions) -> list[Observation]:
        return [Observation(self.rate(), self._attrs)]


def producer_links(headers_of_batch: Iterable[Iterable[tuple[str, bytes | None]]], limit: int) -> list[Link]:
    """Span links to the distinct producer trace contexts (W3C ``traceparent``) of a batch, at most
    ``limit``. Parsed directly (not through the propagator) because it runs per record."""
    links: list[Link] = []
    seen: set[str] = set()
    for headers in headers_of_batch:
        if len(links) >= limit:
            break
        for k, v in headers:
            if k != "traceparent" or not v or len(v) != 55:
                continue
            text = v.decode("ascii", "replace")
            parts = text.split("-")
            if len(parts) != 4 or parts[1] in seen:
                break
            try:
                ctx = SpanContext(
                    trace_id=int(parts[1], 16),
                    span_id=int(parts[2], 16),
                    is_remote=True,
                    trace_flags=TraceFlags(int(parts[3], 16)),
                )
            except ValueError:
                break
            if ctx.is_valid:
                seen.add(parts[1])
                links.append(Link(ctx))
            break
    return links

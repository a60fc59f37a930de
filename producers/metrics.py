"""The producer's counters, readable as a dict and exported as OpenTelemetry counters.

Invariant: each OpenTelemetry data point ``flywheel.producer.events{outcome=...}`` equals the
matching counter in :attr:`ProducerCounters.counts` as of the last :meth:`ProducerCounters.publish`.
Increments are plain dict updates on the hot path (``emit`` holds the producer's lock for the
ones callers make); publishing the deltas happens off the hot path, in the sender thread.
"""

from __future__ import annotations

from producers.telemetry import meter

COUNTERS = ("emitted", "sent", "spooled", "errors", "invalid", "dropped")
"""emitted: accepted by ``emit``; sent: acknowledged by the broker; spooled: written to the disk
spool; errors: broker faults (and sender errors); invalid: rejected by ``emit`` (``ValueError``);
dropped: could not be spooled (disk full, or the spool at its ``spool_max_bytes`` bound)."""


class ProducerCounters:
    """Event counts by outcome, with OpenTelemetry export."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = dict.fromkeys(COUNTERS, 0)
        self._published = dict.fromkeys(COUNTERS, 0)
        self._otel = meter("flywheel.producer").create_counter(
            "flywheel.producer.events", unit="{event}", description="producer events by outcome"
        )

    def publish(self) -> None:
        """Add what each counter gained since the last call to the OpenTelemetry counter."""
        for name in COUNTERS:
            value = self.counts[name]
            delta = value - self._published[name]
            if delta:
                self._otel.add(delta, {"outcome": name})
                self._published[name] = value

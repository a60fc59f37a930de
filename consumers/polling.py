"""Polling through broker faults: the backoff and the throttled warnings of the ingest poll thread.

Invariants:
- A transient fault of a poll (``app.core.retry.is_transient``: the broker restarting, a network
  fault) never propagates: it waits a backoff (0.1 s doubling, at most ``max_wait_s``, cut short
  when ``stop`` is set) and the poll returns ``{}``. Any other fault propagates.
- A run of faults is logged once when it starts, then at most every 30 s, and once (at info level)
  when a poll returns records again, which resets the backoff.
- The client reconnects by itself (rejoining its group if its membership expired: reassigned
  partitions seek to the offsets stored in Postgres); nothing here closes or recreates it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from kafka import TopicPartition
from kafka.consumer.fetcher import ConsumerRecord

from app.core.retry import Backoff, is_transient

log = logging.getLogger(__name__)


class PollBackoff:
    """Backoff state of one poll thread polling the broker at ``bootstrap`` (named in its logs)."""

    def __init__(self, bootstrap: str, max_wait_s: float, stop: threading.Event) -> None:
        self.bootstrap = bootstrap
        self._stop = stop
        self._backoff = Backoff(max_wait_s)
        self._faults_since = self._warned_at = 0.0

    def poll(
        self, poll: Callable[[], dict[TopicPartition, list[ConsumerRecord]]]
    ) -> dict[TopicPartition, list[ConsumerRecord]]:
        """Call ``poll`` (one ``KafkaConsumer.poll``) and return its records; ``{}`` after a
        transient fault, once its backoff has passed (or ``stop`` was set meanwhile).

        Raises:
            Exception: a fault that is not transient.
        """
        try:
            records = poll()
        except Exception as exc:
            if not is_transient(exc):
                raise
            now, backoff = time.monotonic(), self._backoff
            if not backoff.failures:
                self._faults_since = self._warned_at = now
                log.warning("polling the Kafka broker at %s failed, retrying until it answers: %s", self.bootstrap, exc)
            elif now - self._warned_at >= 30.0:
                self._warned_at = now
                log.warning(
                    "the Kafka broker at %s still fails polls (%d in %.0fs), retrying: %s",
                    self.bootstrap,
                    backoff.failures + 1,
                    now - self._faults_since,
                    exc,
                )
            self._stop.wait(backoff.next())
            return {}
        if records and self._backoff.failures:
            log.info(
                "the Kafka broker at %s answers again after %d failed polls in %.0fs",
                self.bootstrap,
                self._backoff.failures,
                time.monotonic() - self._faults_since,
            )
            self._backoff.reset()
        return records

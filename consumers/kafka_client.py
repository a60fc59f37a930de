"""One ingest group member's Kafka client: the ``KafkaConsumer``'s construction and lifecycle, the
rebalance listener, seeking assigned partitions to the offsets stored in Postgres, and the advisory
Kafka commit.

Invariants:
- Postgres holds the offsets: every assigned partition is sought to the next offset stored there
  (``app.repositories.events.stored_positions``), or to its beginning where none is stored, before
  anything is fetched from it. Kafka commits are advisory (``enable_auto_commit`` off, commits
  asynchronous, a failed one only logged).
- Seeking runs inside the rebalance callback, which blocks the client's heartbeats: it gives up
  reading the stored offsets after half the session timeout and pauses those partitions instead
  (:attr:`GroupClient.unseeked`); :meth:`GroupClient.seek_paused` seeks and resumes them once
  Postgres answers. A partition is not resumed before it is sought.
- Before partitions are revoked, the pipeline's queued batches are given half the poll interval to
  land (the ``drain`` callback), so the next owner starts where this member stopped.
- :attr:`GroupClient.next` holds, per partition, the next offset this member expects: the stored
  offset it sought to, raised by each commit of applied batches (never lowered by a commit).
- :attr:`GroupClient.log_ids` holds, per partition, the identity of the log the member reads it as
  (``app.core.kafka_meta.log_id_of``): the one stored with the offset it sought to, until
  ``consumers.log_ends`` judges another one the broker reports.
- A group join unfinished after ``join_timeout_s`` (at least 3 x ``max_poll_interval_ms``) is
  abandoned: the client is closed without committing and a fresh one joins.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections.abc import Callable, Collection
from typing import Any

from kafka import KafkaConsumer, TopicPartition
from kafka.consumer.fetcher import ConsumerRecord
from kafka.consumer.subscription_state import ConsumerRebalanceListener
from kafka.net.compat import KafkaNetClient
from kafka.structs import OffsetAndMetadata

from app.core.db import session_scope
from app.core.kafka_meta import log_id_of
from app.core.retry import Backoff, is_transient, retry_transient
from app.repositories.offsets import stored_positions
from consumers.polling import PollBackoff
from consumers.settings import ConsumerSettings
from producers.settings import kafka_security

log = logging.getLogger(__name__)


def kafka_net_client(slow_step_warn_s: float) -> Callable[..., KafkaNetClient]:
    """kafka-python's network client factory (its ``kafka_client`` option) with the loop's slow-step
    warning at ``slow_step_warn_s`` seconds (0 turns it off) instead of its 0.1 s default."""
    return functools.partial(KafkaNetClient, slow_task_threshold_secs=slow_step_warn_s)


class GroupClient:
    """The ``KafkaConsumer`` of one ingest group member (:attr:`consumer`: None until :meth:`connect`
    and after :meth:`close`) and what the member knows of its partitions.

    ``stop`` and ``abort`` are the consumer's events (stop polling; give up retrying); ``drain(timeout_s)``
    waits, at most ``timeout_s`` seconds, for the pipeline's queued batches to land and commits them.
    """

    def __init__(
        self,
        *,
        bootstrap: str,
        topic: str,
        group_id: str,
        client_id: str,
        max_event_bytes: int,
        settings: ConsumerSettings,
        stop: threading.Event,
        abort: threading.Event,
        drain: Callable[[float], None],
    ) -> None:
        self.bootstrap, self.topic, self.group_id, self.client_id = bootstrap, topic, group_id, client_id
        self.max_event_bytes = max_event_bytes
        self.settings = settings
        self._stop, self._abort, self._drain = stop, abort, drain
        self.consumer: Any = None
        self.next: dict[int, int] = {}
        """partition -> the next offset this member expects on it."""
        self.log_ids: dict[int, str | None] = {}
        """partition -> the identity of the log this member reads it as (None: not known yet)."""
        self.assigned_at: float | None = None
        """``time.monotonic()`` of the last assignment sought to its stored offsets."""
        self.unseeked: set[TopicPartition] = set()
        """assigned partitions paused until their stored offsets can be read."""
        self.joining_since: float | None = time.monotonic()
        """``time.monotonic()`` when the current group join began; None once it has finished."""
        self._seek_retry_at, self._seek_backoff = 0.0, Backoff(settings.retry_max_wait_s)
        self._polls = PollBackoff(bootstrap, settings.retry_max_wait_s, stop)

    # ---- lifecycle ------------------------------------------------------------------------------

    def new_consumer(self) -> KafkaConsumer:
        """A ``KafkaConsumer`` subscribed to the topic, with the rebalance listener that seeks to the
        stored offsets.

        Raises:
            Exception: the broker cannot be reached (transient: ``app.core.retry.is_transient``).
        """
        s = self.settings
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            group_id=self.group_id,
            client_id=self.client_id,
            enable_auto_commit=False,
            auto_offset_reset="earliest",
            max_poll_records=s.batch_max_records,
            max_poll_interval_ms=s.max_poll_interval_ms,
            session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms,
            fetch_max_bytes=s.fetch_max_bytes,
            bootstrap_timeout_ms=s.bootstrap_timeout_ms,
            max_partition_fetch_bytes=max(1_048_576, self.max_event_bytes + 65_536),
            kafka_client=kafka_net_client(s.slow_io_step_warn_s),
            **kafka_security(),
        )
        owner = self

        class _SeekToStored(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked: set[TopicPartition]) -> None:
                # Let queued batches land first so the next owner starts where we stopped (if they
                # do not in time, the offset rows they lock make the later write skip what was done).
                owner._drain(owner.settings.max_poll_interval_ms / 2000)
                owner.joining_since = time.monotonic()
                owner.unseeked.difference_update(revoked)
                log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))

            def on_partitions_assigned(self, assigned: set[TopicPartition]) -> None:
                owner.seek_to_stored(consumer, assigned)

        consumer.subscribe([self.topic], listener=_SeekToStored())
        return consumer

    def connect(self) -> bool:
        """Make :attr:`consumer`, retrying (a broker that is down or restarting is a transient fault
        like any other) until it answers; False if the consumer was stopped meanwhile.

        Raises:
            Exception: a fault that is not transient.
        """
        try:
            self.consumer = retry_transient(
                self.new_consumer,
                f"reaching the Kafka broker at {self.bootstrap}",
                self._abort,
                self.settings.retry_max_wait_s,
            )
        except Exception:
            if self._stop.is_set():
                return False
            raise
        return True

    def poll(self, timeout_ms: int | None = None) -> dict[TopicPartition, list[ConsumerRecord]]:
        """One ``KafkaConsumer.poll`` of at most ``batch_max_records`` (``timeout_ms``: default
        ``poll_timeout_ms``); a transient broker fault waits a backoff and returns ``{}``
        (``consumers.polling.PollBackoff``).

        Raises:
            Exception: a fault that is not transient.
        """
        wait_ms = self.settings.poll_timeout_ms if timeout_ms is None else timeout_ms
        return self._polls.poll(
            lambda: self.consumer.poll(timeout_ms=wait_ms, max_records=self.settings.batch_max_records)
        )

    def rejoin_if_stuck(self, now: float) -> None:
        """A group join that has not finished after ``join_timeout_s`` is abandoned and started over
        with a fresh client (seen on tansu after members were SIGKILLed mid-rebalance)."""
        # A healthy join may take the rebalance timeout (= max_poll_interval in kafka-python).
        timeout_s = max(self.settings.join_timeout_s, 3 * self.settings.max_poll_interval_ms / 1000)
        if self.joining_since is None or now - self.joining_since < timeout_s:
            return
        log.warning("group join not finished after %.0fs; rejoining with a new client", now - self.joining_since)
        self._drain(self.settings.shutdown_grace_s)
        try:
            self.consumer.close(autocommit=False)
        except Exception:  # noqa: BLE001 -- the old client is being discarded anyway
            log.debug("closing the stuck consumer failed", exc_info=True)
        self.consumer, self.unseeked = None, set()
        if self.connect():
            self.joining_since = time.monotonic()

    def close(self) -> None:
        """Leave the group without committing and drop the client (idempotent)."""
        if self.consumer is not None:
            try:
                self.consumer.close(autocommit=False)
            except Exception:  # noqa: BLE001 -- closing a dead connection
                log.debug("consumer close failed", exc_info=True)
            self.consumer = None

    # ---- offsets --------------------------------------------------------------------------------

    def read_stored_offsets(self) -> dict[int, tuple[int, str | None]]:
        """The group's stored next offsets of the topic with the identity of the log each counts in,
        ``{partition: (offset, log_id)}``, in a transaction of their own.

        Raises:
            psycopg.Error / sqlalchemy.exc.DBAPIError: database faults.
        """
        with session_scope() as s:
            return stored_positions(s, self.group_id, self.topic)

    def current_log_id(self) -> str | None:
        """The identity of the topic's log as the client last heard it (``app.core.kafka_meta.log_id_of``)."""
        return log_id_of(self.consumer, self.topic)

    def seek_to_stored(self, consumer: KafkaConsumer, assigned: Collection[TopicPartition]) -> None:
        """Seek newly assigned partitions to the offsets stored in Postgres. This runs inside the
        rebalance callback, which blocks the client's heartbeats: if Postgres does not answer within
        half the session timeout (an outage), the partitions are paused instead, so the member stays in
        the group, and the poll loop seeks and resumes them once it answers (:meth:`seek_paused`).

        Raises:
            Exception: a fault that is not transient, or any fault once the consumer gave up retrying.
        """
        self.joining_since = None  # the join is done; what is left is ours to wait for
        try:
            stored = retry_transient(
                self.read_stored_offsets,
                "reading stored offsets",
                self._abort,
                self.settings.retry_max_wait_s,
                give_up_after_s=self.settings.session_timeout_ms / 2000,
            )
        except Exception as exc:
            if not is_transient(exc) or self._abort.is_set():
                raise
            consumer.pause(*assigned)
            self.unseeked.update(assigned)
            self._seek_retry_at = time.monotonic()
            log.warning(
                "partitions %s paused: their stored offsets cannot be read yet (%s); they resume when Postgres answers",
                sorted(tp.partition for tp in assigned),
                str(exc).splitlines()[0],
            )
            return
        self._apply_stored(consumer, assigned, stored)

    def seek_paused(self, now: float) -> None:
        """One try (backing off between tries) at reading the stored offsets of the partitions
        :meth:`seek_to_stored` paused; on success, seek and resume them.

        Raises:
            Exception: a fault that is not transient.
        """
        if not self.unseeked or now < self._seek_retry_at:
            return
        try:
            stored = self.read_stored_offsets()
        except Exception as exc:
            if not is_transient(exc):
                raise
            wait_s = self._seek_backoff.next()
            self._seek_retry_at = now + wait_s
            log.debug("stored offsets still unreadable, next try in %.1fs: %s", wait_s, exc)
            return
        tps = sorted(self.unseeked)
        self._seek_backoff.reset()
        self.unseeked.clear()
        self._apply_stored(self.consumer, tps, stored)
        self.consumer.resume(*tps)

    def _apply_stored(
        self, consumer: KafkaConsumer, assigned: Collection[TopicPartition], stored: dict[int, tuple[int, str | None]]
    ) -> None:
        self.assigned_at = time.monotonic()
        for tp in assigned:
            if tp.partition in stored:
                offset, self.log_ids[tp.partition] = stored[tp.partition]
                consumer.seek(tp, offset)
                self.next[tp.partition] = offset
            else:
                self.log_ids[tp.partition] = None
                consumer.seek_to_beginning(tp)
        log.info(
            "partitions assigned: %s (stored offsets %s)",
            sorted(tp.partition for tp in assigned),
            {tp.partition: stored.get(tp.partition, (None,))[0] for tp in assigned},
        )

    def commit(self, offsets: dict[tuple[str, int], int]) -> None:
        """Raise :attr:`next` to ``offsets`` (``{(topic, partition): next offset}`` of batches
        committed to Postgres) and commit them to Kafka, asynchronously. Advisory: a failed or refused
        commit is logged at debug level, never raised. A no-op without a client."""
        if not offsets or self.consumer is None:
            return

        for (_, p), o in offsets.items():
            self.next[p] = max(self.next.get(p, 0), o)

        def done(_offsets: object, result: object) -> None:
            if isinstance(result, Exception):  # advisory only: Postgres holds the offsets
                log.debug("kafka offset commit failed: %s", result)

        try:
            self.consumer.commit_async(
                {TopicPartition(t, p): OffsetAndMetadata(o, "", -1) for (t, p), o in offsets.items()}, callback=done
            )
        except Exception as exc:  # noqa: BLE001 -- e.g. a rebalance in progress; Postgres is the truth
            log.debug("kafka offset commit refused: %s", exc)

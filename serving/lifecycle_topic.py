"""Following the lifecycle topic: the one read loop the serving watcher and the serving front share.

Invariants:

- the topic is read over ALL its partitions by manual assignment (no consumer group): every
  replica (each watcher, each front) sees every change;
- a partition with a known position resumes there, one without starts at the topic's beginning or
  end (``start_at``); positions are resolved when the consumer connects, so a caller that reads
  other state right after :meth:`LifecycleTopicFollower.connect` misses no change made between;
  a position the broker no longer holds (a memory-only broker that restarted, a topic deleted and
  re-created) resumes at the partition's beginning: the handlers dedupe, so a replay costs nothing
  where a skip would lose a change. The follower knows such a log two ways, and reads every
  partition of it again from offset 0 on a new consumer (kafka-python's fetches of a re-created
  topic by the client that knew the old one returned nothing, measured; tansu 0.5 answers the old
  position's fetches with nothing, not an out-of-range error):
  - its identity (:func:`app.core.kafka_meta.log_id_of`: the broker's topic id) differs from the
    one the follower read before, checked after every poll (that poll's records dropped) and at
    every connect (a new consumer after a fault). This holds when the new log has already grown
    past the old position, where offsets alone would skip its first records;
  - a partition ends below its position (the last fetch's high-water mark; tansu's ``ListOffsets``
    under-reports the end), checked after every empty poll: a broker without topic ids, or a
    follower that never saw the old log's identity (it started on the new log with saved positions);
- every record is parsed once into the typed message (:func:`app.lifecycle.messages.parse_lifecycle_message`);
  one that does not parse is logged and skipped, its offset consumed;
- a batch's positions advance only once its handler returned: a handler that raises leaves them
  where they were and the batch is read again (the relay is at-least-once, so handlers dedupe
  anyway);
- a fault is retried with backoff (1 s doubling, at most 30 s) on a fresh consumer that resumes at
  the positions; a fault the ``retry`` predicate refuses propagates out of :meth:`run`.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from kafka import KafkaConsumer, TopicPartition

from app.core.kafka_meta import log_id_of
from app.core.retry import Backoff
from app.lifecycle.messages import LifecycleMessage, LifecycleMessageError, parse_lifecycle_message
from producers.settings import kafka_security

log = logging.getLogger("flywheel.lifecycle_topic")

StartAt = Literal["beginning", "end"]


@dataclass(frozen=True)
class LifecycleRecord:
    """One lifecycle message as read: the typed message and the Kafka headers it came with (trace
    context, ``outbox-id``)."""

    message: LifecycleMessage
    headers: list[tuple[str, bytes]] = field(default_factory=list)


@dataclass(frozen=True)
class LifecycleBatch:
    """What one poll read: the records that parsed, and ``positions`` (partition -> the next offset
    to read) past every record of the batch, skipped ones included."""

    records: list[LifecycleRecord]
    positions: dict[int, int]


def _always(exc: BaseException) -> bool:
    return True


class LifecycleTopicFollower:
    """Reads the lifecycle topic and hands each batch to ``handle`` (see the module invariants).

    Args:
        handle: applies one batch; raising leaves the positions where they were.
        bootstrap: the broker (``host:port``).
        topic: the lifecycle topic.
        client_id: the Kafka client id (which follower this is, in the broker's logs).
        start_at: where a partition without a known position starts.
        positions: known positions (partition -> next offset), e.g. saved by a previous run.
        retry: whether :meth:`run` retries a fault (default: every fault).
        before_poll: run by :meth:`run` before each poll (the watcher's server supervision).
    """

    def __init__(
        self,
        handle: Callable[[LifecycleBatch], None],
        *,
        bootstrap: str,
        topic: str,
        client_id: str,
        start_at: StartAt,
        positions: Mapping[int, int] | None = None,
        retry: Callable[[BaseException], bool] = _always,
        before_poll: Callable[[], object] | None = None,
    ) -> None:
        self.handle = handle
        self.bootstrap = bootstrap
        self.topic = topic
        self.client_id = client_id
        self.start_at: StartAt = start_at
        self.positions: dict[int, int] = dict(positions or {})
        self.retry = retry
        self.before_poll = before_poll
        self._consumer: KafkaConsumer | None = None
        self._log_id: str | None = None  # the topic's log identity as last read; kept across consumers
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def connected(self) -> bool:
        """Whether a consumer is open (positions resolved)."""
        return self._consumer is not None

    def connect(self) -> KafkaConsumer:
        """The open consumer, assigned every partition and placed at its position (a no-op when open).

        Raises:
            kafka.errors.KafkaError: the broker does not answer.
        """
        if self._consumer is not None:
            return self._consumer
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            group_id=None,
            auto_offset_reset="earliest",
            client_id=self.client_id,
            **kafka_security(),
        )
        partitions = consumer.partitions_for_topic(self.topic) or {0}
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        if self._log_replaced(consumer):
            self.positions = dict.fromkeys(sorted(partitions), 0)
        self._place(consumer, tps)
        for tp in tps:  # resolved now, so state read after connect() misses nothing
            position = consumer.position(tp)  # None only past a timeout, which this call has not
            if position is not None:
                self.positions[tp.partition] = position
        self._consumer = consumer
        return consumer

    def _place(self, consumer: KafkaConsumer, tps: list[TopicPartition]) -> None:
        for tp in tps:
            if tp.partition in self.positions:
                consumer.seek(tp, self.positions[tp.partition])
            elif self.start_at == "beginning":
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek_to_end(tp)

    def replay_from_beginning(self) -> None:
        """Forget every position and read the topic from its beginning (a follower that cannot read
        the current state elsewhere rebuilds it from the topic's history)."""
        self.start_at = "beginning"
        self.positions.clear()
        if self._consumer is not None:
            self._consumer.seek_to_beginning()

    def poll_once(self, timeout_ms: int = 1000) -> int:
        """Read one batch, hand it to ``handle`` and advance the positions; returns how many records
        the batch held (0: nothing new, ``handle`` not called).

        Raises:
            Exception: what ``handle`` raised (the batch is read again next time), or a broker fault
                (``kafka.errors.KafkaError``).
        """
        consumer = self.connect()
        polled = consumer.poll(timeout_ms=timeout_ms, max_records=500)
        if self._log_replaced(consumer):  # these records may come from the new log's middle
            self.positions = {tp.partition: 0 for tp in consumer.assignment()}
            self._close()
            return 0
        records: list[LifecycleRecord] = []
        positions: dict[int, int] = {}
        for tp, msgs in polled.items():
            for m in msgs:
                positions[tp.partition] = m.offset + 1
                try:
                    message = parse_lifecycle_message(m.value)
                except LifecycleMessageError as exc:
                    log.warning("skipping lifecycle message %s:%s: %s", tp.partition, m.offset, exc)
                    continue
                records.append(LifecycleRecord(message, list(m.headers or [])))
        if not positions:
            self._reread_recreated_logs(consumer)
            return 0
        try:
            self.handle(LifecycleBatch(records, positions))
        except Exception:
            self._place(consumer, list(consumer.assignment()))  # read this batch again next time
            raise
        self.positions.update(positions)
        return sum(len(msgs) for msgs in polled.values())

    def _log_replaced(self, consumer: KafkaConsumer) -> bool:
        """Whether the topic's log identity as ``consumer`` last heard it differs from the one read
        before (logged); records the identity either way (the first one seen is taken as it is)."""
        current = log_id_of(consumer, self.topic)
        previous, self._log_id = self._log_id, current or self._log_id
        if current is None or previous is None or current == previous:
            return False
        log.warning(
            "%s: lifecycle topic %s is another log (identity %s -> %s): the topic was re-created (a "
            "restarted broker); reading every partition from its start",
            self.client_id, self.topic, previous, current,
        )  # fmt: skip
        return True

    def _reread_recreated_logs(self, consumer: KafkaConsumer) -> bool:
        """Read again from offset 0 every partition whose log ends below the position read to (see
        the module invariants); returns whether any did."""
        stale = []
        for tp in consumer.assignment():
            end, position = consumer.highwater(tp), consumer.position(tp)
            if end is not None and position is not None and position > end:
                log.warning(
                    "%s: lifecycle partition %s:%d ends at %d, below the position %d read to: the log "
                    "was re-created (a restarted broker); reading it from its start",
                    self.client_id, tp.topic, tp.partition, end, position,
                )  # fmt: skip
                stale.append(tp.partition)
        if not stale:
            return False
        for partition in stale:
            self.positions[partition] = 0
        self._close()
        return True

    def caught_up(self) -> bool:
        """Whether every partition has been read to its current end offset.

        Raises:
            kafka.errors.KafkaError: the broker does not answer.
        """
        consumer = self.connect()
        ends = consumer.end_offsets(list(consumer.assignment()))
        return all((consumer.position(tp) or 0) >= end for tp, end in ends.items())

    def run(self, *, idle_exit: bool = False, poll_ms: int = 1000) -> None:
        """Poll until :meth:`stop` (or, with ``idle_exit``, until the topic is read to its end); a
        fault is logged and retried on a fresh consumer (module invariants) while the caller keeps
        what it has.

        Raises:
            Exception: a fault ``retry`` refuses.
        """
        backoff = Backoff(30.0, initial=1.0)
        while not self._stop.is_set():
            if self.before_poll is not None:
                self.before_poll()
            try:
                self.poll_once(timeout_ms=poll_ms)
                backoff.reset()
                if idle_exit and self.caught_up():
                    return
            except Exception as exc:
                if not self.retry(exc):
                    raise
                wait_s = backoff.next()
                first_line = str(exc).splitlines()[0] if str(exc) else ""
                log.warning(
                    "%s: following the lifecycle topic failed (%s: %s); retrying in %.0fs",
                    self.client_id,
                    type(exc).__name__,
                    first_line,
                    wait_s,
                )
                self._close()
                self._stop.wait(wait_s)

    def start(self, name: str) -> threading.Thread:
        """Run in a daemon thread called ``name``."""
        self._thread = threading.Thread(target=self.run, name=name, daemon=True)
        self._thread.start()
        return self._thread

    def request_stop(self) -> None:
        """Make :meth:`run` return after its current poll (safe in a signal handler)."""
        self._stop.set()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop following: end the thread (if started) and close the consumer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        self._close()

    def _close(self) -> None:
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

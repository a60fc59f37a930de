"""The ingest consumer (``flywheel consume``): Kafka consumer group -> Postgres, exactly-once effect.

Two threads, a two-stage pipeline (Postgres works on batch k while Kafka fetches and Python
decodes batch k+1):

- the *poll* thread owns the Kafka client (``consumers.kafka_client``: the ``KafkaConsumer``, its
  rebalances, seeks to stored offsets): poll up to ``batch_max_records`` -> classify each
  record (event or dead letter) -> hand the batch to the DB thread (a queue ``pipeline_depth``
  deep) -> commit to Kafka the offsets of batches the DB thread has committed (advisory: Postgres
  is the source of truth; every assignment seeks to the offsets stored there). If the queue stays
  full (the DB thread retrying through an outage) it pauses its partitions and keeps polling, so it
  stays in the group instead of being evicted;
- the *DB* thread, per batch: ONE Postgres transaction (``consumers.batch.apply_batch``: events,
  projections, dead letters, offsets), which before it commits publishes the dead letters it stored
  to the DLQ topic (as stored: an erasure in the batch may have removed or stripped some); and
  every ``finalize_interval_s`` the window sweep.

This module owns the pipeline between the two threads: the queue, hand-over, draining, shutdown.
Around it: ``consumers.polling`` (riding out broker faults), ``consumers.log_ends`` (re-created
logs), ``consumers.lag`` (the lag gauge), ``consumers.gc_tuning`` (GIL and collector settings
while ``run`` runs); counts in ``consumers.counts``.

Size: over 400 lines because the two threads share the pipeline's state (the queue, the batches
committed but not yet acknowledged to Kafka, paused partitions, the shutdown order), which is this
module's one job; what surrounds it already lives in the modules named above.

Failure handling (the consumer never crashes on input):

- transient database or broker faults (a broker not up yet at start too) are retried with exponential
  backoff until they pass (``app.core.retry``); the batch waits in memory, never dead-lettered;
- a batch that fails for any other reason is applied again bisected in savepoints
  (``consumers.isolation``); a record that fails alone is dead-lettered as ``processing_error`` and
  the batch goes on;
- SIGKILL at any point loses nothing: uncommitted work is redelivered from the stored offsets,
  and records below a stored offset are skipped (so a zombie member after a rebalance, or a
  batch still queued when its partition moved, cannot apply anything twice);
- a partition's log re-created (a local broker restarted empty, a topic re-created), seen by its
  identity (the broker's topic id, stored beside the offsets) or by a stored offset past its end,
  is reported and, by default, re-read from its start (``consumers.offsets``), never skipped in
  silence;
- a record whose values are physically implausible, or whose ``event_id`` is stored with another
  body, is a dead letter (``consumers.classify``).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any, TypeVar

from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.core.retry import is_transient, is_unique_violation, retry_transient
from app.core.settings import get_settings
from app.core.telemetry import tracer
from app.repositories.events import stored_dead_letters
from consumers import offsets
from consumers.batch import apply_batch
from consumers.classify import Decoded, Message, classify
from consumers.counts import BatchOutcome, IngestStats
from consumers.deadletter import DeadLetterPublisher
from consumers.finalize import finalize_due
from consumers.gc_tuning import tuned_for_ingest
from consumers.isolation import apply_isolated
from consumers.kafka_client import GroupClient
from consumers.lag import partition_lag
from consumers.log_ends import check_log_ends
from consumers.privacy_locks import privacy_flagged_sessions, publish_private_sessions
from consumers.projection import ProjectionConfig, Projector
from consumers.rewards.spec import active_specs
from consumers.settings import ConsumerSettings, get_consumer_settings
from consumers.telemetry import ConsumerMetrics, producer_links

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)
_STOP = object()
T = TypeVar("T")


def projector_from_settings(cs: ConsumerSettings | None = None) -> Projector:
    """The projector with the configured window and active reward specs."""
    cs = cs or get_consumer_settings()
    return Projector(
        ProjectionConfig(
            signal_window_s=cs.signal_window_s,
            abandon_after_s=cs.abandon_after_s,
            eval_reserve_fraction=cs.eval_reserve_fraction,
        ),
        active_specs(),
    )


class IngestConsumer:
    """One member of the ingest consumer group. ``run()`` until ``stop()`` (or idle / a count).

    Its Kafka client (:attr:`client`, ``consumers.kafka_client.GroupClient``) owns the
    ``KafkaConsumer`` and the partitions' offsets; this class owns the pipeline between the poll
    thread and the DB thread.
    """

    def __init__(
        self,
        *,
        bootstrap: str | None = None,
        topic: str | None = None,
        group_id: str | None = None,
        dlq_topic: str | None = None,
        settings: ConsumerSettings | None = None,
        client_id: str = "flywheel-ingest",
    ) -> None:
        ks = get_settings().kafka
        self.settings = settings or get_consumer_settings()
        self.bootstrap = bootstrap or ks.bootstrap
        if not self.bootstrap:
            raise ConfigurationError("no Kafka bootstrap: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel stack up`")
        self.topic = topic or ks.interactions_topic
        self.dlq_topic = dlq_topic or ks.dlq_topic
        self.group_id = group_id or ks.consumer_group
        self.max_event_bytes = ks.max_event_bytes
        self.client_id = client_id
        self.projector = projector_from_settings(self.settings)
        self.metrics = ConsumerMetrics(self.topic, self.group_id)
        self.stats = IngestStats()
        self._stop = threading.Event()  # finish what is queued, then return
        self._abort = threading.Event()  # give up retrying (shutdown during an outage)
        self.client = GroupClient(
            bootstrap=self.bootstrap,
            topic=self.topic,
            group_id=self.group_id,
            client_id=client_id,
            max_event_bytes=self.max_event_bytes,
            settings=self.settings,
            stop=self._stop,
            abort=self._abort,
            drain=self._drain,
        )
        self._dlq = DeadLetterPublisher(
            self.bootstrap, self.dlq_topic, self.settings.dlq_max_bytes, client_id=f"{client_id}-dlq"
        )
        self._tracer = tracer("flywheel.consumers.ingest")
        self._work: queue.Queue[Any] = queue.Queue(maxsize=self.settings.pipeline_depth)
        self._done: queue.Queue[dict[tuple[str, int], int]] = queue.Queue()
        self._worker_error: BaseException | None = None
        self._fatal: offsets.OffsetBeyondLogEnd | None = None  # offset_reset = fail found a re-created log
        self._last_sweep = time.monotonic()

    # ---- plumbing ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to stop polling, apply what is queued and return (signal-safe)."""
        self._stop.set()
        if self.client.consumer is None:  # still reaching the broker: nothing is queued, stop retrying
            self._abort.set()

    def retry(self, fn: Callable[[], T], what: str) -> T:
        """``app.core.retry.retry_transient`` bound to this consumer's abort flag."""
        return retry_transient(fn, what, self._abort, self.settings.retry_max_wait_s)

    def classify(self, messages: list[Message]) -> list[Decoded]:
        """``consumers.classify.classify`` each record, ``occurred_at`` judged against now (UTC)."""
        window = self.settings.time_window(datetime.now(UTC))
        return [classify(m, self.max_event_bytes, window) for m in messages]

    def _publish_dead_letters(self, session: Session, outcome: BatchOutcome) -> None:
        """Publish the batch's stored dead letters to the DLQ topic, as the transaction about to
        commit holds them, and wait for the acks. Run before the commit (a failure rolls the batch
        back and it is retried whole: at least once on the topic, exactly once in the table), while
        the projection lock keeps erasures out: an erasure in the batch has deleted or stripped
        what it covers, and the topic gets the same."""
        if outcome.dead_letter_positions:
            self._dlq.publish(stored_dead_letters(session, outcome.dead_letter_positions))

    # ---- one batch (DB thread) -----------------------------------------------------------------

    def _apply(self, decoded: list[Decoded]) -> BatchOutcome:
        flagged = privacy_flagged_sessions(decoded)
        if flagged:
            with session_scope() as session:  # its own short transaction, ahead of the batch's
                publish_private_sessions(session, flagged)
        with session_scope() as session:
            outcome = apply_batch(session, self.group_id, decoded, self.projector, self.settings.insert_method)
            self._publish_dead_letters(session, outcome)
            return outcome

    def process(self, messages: list[Message], decoded: list[Decoded] | None = None) -> BatchOutcome:
        """Dead-letter and apply one batch (retrying transient faults). No Kafka commit."""
        started = time.perf_counter()
        if decoded is None:
            decoded = self.classify(messages)
        links = producer_links((m.headers for m in messages), self.settings.max_span_links)
        with self._tracer.start_as_current_span(
            "consumers.ingest.batch",
            links=links,
            attributes={
                "messaging.system": "kafka",
                "messaging.destination.name": self.topic,
                "messaging.consumer.group.name": self.group_id,
                "messaging.batch.message_count": len(messages),
            },
        ) as span:
            try:
                outcome = self.retry(lambda: self._apply(decoded), "batch transaction")
            except Exception as exc:  # noqa: BLE001
                if is_transient(exc):
                    raise
                if is_unique_violation(exc):
                    log.info(
                        "batch raced another group member for the same rows (%s); redoing it record-isolated",
                        str(exc).splitlines()[0],
                    )
                else:
                    log.warning("batch failed (%s); bisecting it to isolate the record(s) at fault", exc)
                outcome, errors = self.retry(
                    lambda: apply_isolated(
                        self.group_id, decoded, self.projector, before_commit=self._publish_dead_letters
                    ),
                    "isolated batch transaction",
                )
                self.stats.processing_errors += errors
            for (topic, partition), (stored_log, batch_log) in outcome.foreign_log.items():
                log.warning(
                    "%s:%d: records read from log %s skipped: the group's stored offset counts in log %s "
                    "(the log was re-created; the member re-reads it once it sees the new one)",
                    topic,
                    partition,
                    batch_log,
                    stored_log,
                )
            for (topic, partition), (stored, first) in outcome.offset_gaps.items():
                log.error(
                    "%s:%d: offsets %d..%d (%d records) were gone from the broker when this group read on "
                    "(retention deleted them before they were consumed): their events are not in event_log",
                    topic,
                    partition,
                    stored,
                    first - 1,
                    first - stored,
                )
            span.set_attribute("flywheel.events.stored", outcome.stored)
            span.set_attribute("flywheel.dead_letters", sum(outcome.dead_letters.values()))
        self.metrics.record_batch(outcome, time.perf_counter() - started)
        self.stats.add(outcome)
        return outcome

    def _sweep_if_due(self) -> None:
        if time.monotonic() - self._last_sweep < self.settings.finalize_interval_s:
            return
        done = self.retry(lambda: finalize_due(self.projector, self.settings.finalize_grace_s), "finalize sweep")
        self.metrics.record_finalized(done)
        self.stats.finalized.update(done)
        self._last_sweep = time.monotonic()

    def _db_loop(self) -> None:
        try:
            while True:
                try:
                    item = self._work.get(timeout=0.2)
                except queue.Empty:
                    self._sweep_if_due()
                    continue
                try:
                    if item is _STOP:
                        return
                    messages, decoded = item
                    self._done.put(self.process(messages, decoded).next_offsets)
                    self._sweep_if_due()
                finally:
                    self._work.task_done()
        except BaseException as exc:  # noqa: BLE001 -- handed to the poll thread, which raises it
            self._worker_error = exc
            self._stop.set()
            while True:  # unblock a poll thread waiting on a full queue
                try:
                    self._work.get_nowait()
                    self._work.task_done()
                except queue.Empty:
                    break

    # ---- the poll thread -------------------------------------------------------------------

    def _drain(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s``) until the DB thread has applied every queued batch."""
        deadline = time.monotonic() + timeout_s
        while self._work.unfinished_tasks and time.monotonic() < deadline and self._worker_error is None:
            time.sleep(0.01)
        self._commit_done()

    def _commit_done(self) -> None:
        """Commit to Kafka (advisory) the offsets of batches the DB thread has committed."""
        done: dict[tuple[str, int], int] = {}
        while True:
            try:
                for k, v in self._done.get_nowait().items():
                    done[k] = max(done.get(k, 0), v)
            except queue.Empty:
                break
        self.client.commit(done)

    def _hand_over(self, item: tuple[list[Message], list[Decoded]]) -> None:
        """Queue a batch for the DB thread. Normally a slot frees within one batch time; if the DB
        stage is stuck (an outage being retried), keep the group membership alive with paused polls
        (no fetching, so nothing piles up) instead of being evicted after ``max_poll_interval_ms``."""
        keepalive_s = self.settings.max_poll_interval_ms / 2000
        last_poll, paused = time.monotonic(), False
        consumer = self.client.consumer
        while not self._stop.is_set():
            try:
                self._work.put(item, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() - last_poll < keepalive_s:
                    continue
                if not paused:
                    consumer.pause(*consumer.assignment())
                    paused = True
                extra = self.client.poll(timeout_ms=0)  # keeps the member in its group; rides out a broker fault
                for tp, recs in extra.items():  # partitions assigned by a rebalance meanwhile
                    consumer.seek(tp, recs[0].offset)  # not taken: fetch them again later
                last_poll = time.monotonic()
        if paused:  # not those still waiting for their stored offsets
            consumer.resume(*(set(consumer.paused()) - self.client.unseeked))

    def run(self, *, idle_exit_s: float | None = None, stop_after: int | None = None) -> IngestStats:
        """Consume until ``stop()``, ``idle_exit_s`` seconds without records, or ``stop_after`` records;
        then apply what is queued, leave the group and return the totals. The interpreter is tuned
        for the two threads meanwhile (``consumers.gc_tuning``).

        Raises:
            Exception: a fault the DB thread could not handle (not input: input is dead-lettered).
        """
        with tuned_for_ingest():
            return self._run(idle_exit_s, stop_after)

    def _run(self, idle_exit_s: float | None, stop_after: int | None) -> IngestStats:
        client = self.client
        if not client.connect():  # stopped while reaching the broker: nothing was consumed
            self.close()
            return self.stats
        worker = threading.Thread(target=self._db_loop, name="flywheel-ingest-db", daemon=True)
        worker.start()
        last_record, polled = time.monotonic(), 0
        try:
            while not self._stop.is_set():
                self._commit_done()
                records = client.poll()
                self._fatal, sought = check_log_ends(client, self._drain, self.retry, self.metrics)
                if self._fatal is not None:
                    self._stop.set()
                    break
                messages = [
                    Message.from_record(r, client.log_ids.get(tp.partition))
                    for tp, recs in records.items()
                    if tp not in sought
                    for r in recs
                ]
                now = time.monotonic()
                if messages:
                    if self.stats.first_record_at is None:
                        self.stats.first_record_at = now
                        log.info("first record polled at %.6f (unix s)", time.time())
                    decoded = self.classify(messages)
                    self._hand_over((messages, decoded))
                    polled += len(messages)
                    last_record = now
                client.seek_paused(now)
                self.metrics.set_lag(partition_lag(client.consumer, client.next))
                client.rejoin_if_stuck(now)
                if stop_after is not None and polled >= stop_after:
                    break
                # idle time counts from the later of the last record and the last (re)assignment
                if (
                    idle_exit_s is not None
                    and client.assigned_at is not None
                    and not self._work.unfinished_tasks
                    and not client.unseeked
                    and now - max(last_record, client.assigned_at) >= idle_exit_s
                ):
                    break
        finally:
            self._shutdown(worker)
            self.stats.last_batch_at = time.monotonic()
            self._commit_done()
            # the lag gauge from the offsets just committed: the loop's last snapshot may predate the
            # DB thread's last batch (it finished between that poll and the idle check)
            if client.consumer is not None:
                self.metrics.set_lag(partition_lag(client.consumer, client.next))
            self.close()
        if self._worker_error is not None and not self._abort.is_set():
            raise self._worker_error
        if self._fatal is not None:
            raise self._fatal
        return self.stats

    def _shutdown(self, worker: threading.Thread) -> None:
        """Let the DB thread apply what is queued; past ``shutdown_grace_s`` (an outage), abandon it:
        uncommitted batches are redelivered to whoever owns the partitions next."""
        deadline = time.monotonic() + self.settings.shutdown_grace_s
        while worker.is_alive():
            try:
                self._work.put(_STOP, timeout=0.2)
                break
            except queue.Full:
                if time.monotonic() > deadline:
                    break
        worker.join(timeout=max(0.0, deadline - time.monotonic()))
        if worker.is_alive():
            log.warning(
                "abandoning queued batches after %.0fs (they will be redelivered)", self.settings.shutdown_grace_s
            )
            self._abort.set()
            worker.join()

    def close(self) -> None:
        """Leave the group and close clients (idempotent)."""
        self.client.close()
        self._dlq.close()

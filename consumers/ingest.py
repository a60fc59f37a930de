"""The ingest consumer (``flywheel consume``): Kafka consumer group -> Postgres, exactly-once effect.

Two threads, a two-stage pipeline (Postgres works on batch k while Kafka fetches and Python
decodes batch k+1):

- the *poll* thread owns the ``KafkaConsumer``: poll up to ``batch_max_records`` -> classify each
  record (event or dead letter) -> hand the batch to the DB thread (a queue ``pipeline_depth``
  deep) -> commit to Kafka the offsets of batches the DB thread has committed (advisory: Postgres
  is the source of truth; every assignment seeks to the offsets stored there). If the queue stays
  full (the DB thread retrying through an outage) it pauses its partitions and keeps polling, so it
  stays in the group instead of being evicted;
- the *DB* thread, per batch: ONE Postgres transaction (``consumers.batch.apply_batch``: events,
  projections, dead letters, offsets), which before it commits publishes the dead letters it stored
  to the DLQ topic (as stored: an erasure in the batch may have removed or stripped some); and
  every ``finalize_interval_s`` the window sweep.

Failure handling (the consumer never crashes on input):

- transient database or broker faults (a broker not up yet at start too) are retried with exponential
  backoff until they pass (``consumers.retry``); the batch waits in memory, never dead-lettered;
- a batch that fails for any other reason is applied again bisected in savepoints
  (``consumers.isolation``); a record that fails alone is dead-lettered as ``processing_error`` and
  the batch goes on;
- SIGKILL at any point loses nothing: uncommitted work is redelivered from the stored offsets,
  and records below a stored offset are skipped (so a zombie member after a rebalance, or a
  batch still queued when its partition moved, cannot apply anything twice);
- a stored offset past its partition's log end (the log was re-created: a local broker restarted
  empty, a topic re-created) is reported and, by default, the partition re-read from its start
  (``consumers.offsets``), never skipped in silence;
- a record whose values are physically implausible, or whose ``event_id`` is stored with another
  body, is a dead letter (``consumers.deadletter``).
"""

from __future__ import annotations

import functools
import gc
import logging
import queue
import sys
import threading
import time
from datetime import datetime, timezone
from typing import TYPE_CHECKING, Any

from app.core.db import session_scope
from app.core.settings import get_settings
from app.core.telemetry import tracer
from app.repositories.events import stored_dead_letters
from consumers import offsets
from consumers.batch import apply_batch
from consumers.counts import BatchOutcome, IngestStats
from consumers.deadletter import Decoded, DeadLetterPublisher, Message, classify
from consumers.finalize import finalize_due
from consumers.isolation import apply_isolated
from consumers.privacy_locks import privacy_flagged_sessions, publish_private_sessions
from consumers.projection import ProjectionConfig, Projector
from consumers.retry import Backoff, is_transient, is_unique_violation, retry_transient
from consumers.rewards.spec import active_specs
from consumers.settings import ConsumerSettings, get_consumer_settings
from consumers.telemetry import ConsumerMetrics, producer_links

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

log = logging.getLogger(__name__)
_STOP = object()


def projector_from_settings(cs: ConsumerSettings | None = None) -> Projector:
    """The projector with the configured window and active reward specs."""
    cs = cs or get_consumer_settings()
    return Projector(ProjectionConfig(signal_window_s=cs.signal_window_s, abandon_after_s=cs.abandon_after_s,
                                      eval_reserve_fraction=cs.eval_reserve_fraction), active_specs())


def kafka_net_client(slow_step_warn_s: float):
    """kafka-python's network client factory (its ``kafka_client`` option) with the loop's slow-step
    warning at ``slow_step_warn_s`` seconds (0 turns it off) instead of its 0.1 s default."""
    from kafka.net.compat import KafkaNetClient

    return functools.partial(KafkaNetClient, slow_task_threshold_secs=slow_step_warn_s)


class IngestConsumer:
    """One member of the ingest consumer group. ``run()`` until ``stop()`` (or idle / a count)."""

    def __init__(self, *, bootstrap: str | None = None, topic: str | None = None, group_id: str | None = None,
                 dlq_topic: str | None = None, settings: ConsumerSettings | None = None,
                 client_id: str = "flywheel-ingest") -> None:
        ks = get_settings().kafka
        self.settings = settings or get_consumer_settings()
        self.bootstrap = bootstrap or ks.bootstrap
        if not self.bootstrap:
            from app.core.errors import ConfigurationError

            raise ConfigurationError("no Kafka bootstrap: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel stack up`")
        self.topic = topic or ks.interactions_topic
        self.dlq_topic = dlq_topic or ks.dlq_topic
        self.group_id = group_id or ks.consumer_group
        self.max_event_bytes = ks.max_event_bytes
        self.client_id = client_id
        self.projector = projector_from_settings(self.settings)
        self.metrics = ConsumerMetrics(self.topic, self.group_id)
        self.stats = IngestStats()
        self._stop = threading.Event()      # finish what is queued, then return
        self._abort = threading.Event()     # give up retrying (shutdown during an outage)
        self._consumer: Any = None
        self._dlq = DeadLetterPublisher(self.bootstrap, self.dlq_topic, self.settings.dlq_max_bytes,
                                        client_id=f"{client_id}-dlq")
        self._tracer = tracer("flywheel.consumers.ingest")
        self._next: dict[int, int] = {}
        self._assigned_at: float | None = None
        self._unseeked: set = set()  # assigned partitions paused until their stored offsets can be read
        self._seek_retry_at, self._seek_backoff = 0.0, Backoff(self.settings.retry_max_wait_s)
        self._joining_since: float | None = time.monotonic()
        self._work: queue.Queue = queue.Queue(maxsize=self.settings.pipeline_depth)
        self._done: queue.Queue = queue.Queue()
        self._worker_error: BaseException | None = None
        self._fatal: offsets.OffsetBeyondLogEnd | None = None  # offset_reset = fail found a re-created log
        self._last_sweep = time.monotonic()
        self._poll_backoff, self._poll_faults_since, self._poll_warned_at = \
            Backoff(self.settings.retry_max_wait_s), 0.0, 0.0  # see _poll

    # ---- plumbing ---------------------------------------------------------------------------

    def stop(self) -> None:
        """Ask ``run`` to stop polling, apply what is queued and return (signal-safe)."""
        self._stop.set()
        if self._consumer is None:  # still reaching the broker: nothing is queued, stop retrying
            self._abort.set()

    def retry(self, fn, what: str):
        """``consumers.retry.retry_transient`` bound to this consumer's abort flag."""
        return retry_transient(fn, what, self._abort, self.settings.retry_max_wait_s)

    def _kafka_consumer(self):
        from kafka import KafkaConsumer
        from kafka.consumer.subscription_state import ConsumerRebalanceListener

        s = self.settings
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap, group_id=self.group_id, client_id=self.client_id,
            enable_auto_commit=False, auto_offset_reset="earliest", max_poll_records=s.batch_max_records,
            max_poll_interval_ms=s.max_poll_interval_ms, session_timeout_ms=s.session_timeout_ms,
            heartbeat_interval_ms=s.heartbeat_interval_ms, fetch_max_bytes=s.fetch_max_bytes,
            bootstrap_timeout_ms=s.bootstrap_timeout_ms,
            max_partition_fetch_bytes=max(1_048_576, self.max_event_bytes + 65_536),
            kafka_client=kafka_net_client(s.slow_io_step_warn_s))
        owner = self

        class _SeekToStored(ConsumerRebalanceListener):
            def on_partitions_revoked(self, revoked) -> None:
                # Let queued batches land first so the next owner starts where we stopped (if they
                # do not in time, the offset rows they lock make the later write skip what was done).
                owner._drain(timeout_s=owner.settings.max_poll_interval_ms / 2000)
                owner._joining_since = time.monotonic()
                owner._unseeked.difference_update(revoked)
                log.info("partitions revoked: %s", sorted(tp.partition for tp in revoked))

            def on_partitions_assigned(self, assigned) -> None:
                owner._seek_to_stored(consumer, assigned)

        consumer.subscribe([self.topic], listener=_SeekToStored())
        return consumer

    def _read_stored_offsets(self) -> dict[int, int]:
        from app.repositories.events import stored_offsets

        with session_scope() as s:
            return stored_offsets(s, self.group_id, self.topic)

    def _connect(self) -> bool:
        """Make ``self._consumer``, retrying (a broker that is down or restarting is a transient fault
        like any other) until it answers; False if the consumer was stopped meanwhile.

        Raises:
            Exception: a fault that is not transient.
        """
        try:
            self._consumer = self.retry(self._kafka_consumer, f"reaching the Kafka broker at {self.bootstrap}")
        except Exception:
            if self._stop.is_set():
                return False
            raise
        return True

    def _poll(self, timeout_ms: int | None = None) -> dict:
        """One ``KafkaConsumer.poll`` (``timeout_ms``: default ``poll_timeout_ms``). The broker going
        away mid-stream (a restart, a network fault) makes polls raise, every other one or so: each
        such fault waits a backoff (0.1 s doubling, at most ``retry_max_wait_s``, cut short by
        :meth:`stop`) and returns ``{}``. The client reconnects by itself (rejoining its group if its
        membership expired: reassigned partitions seek to the offsets stored in Postgres); meanwhile
        the DB thread applies what was polled before. Logged once, then at most every 30 s, until
        records flow again.

        Raises:
            Exception: a fault that is not transient.
        """
        try:
            wait_ms = self.settings.poll_timeout_ms if timeout_ms is None else timeout_ms
            records = self._consumer.poll(timeout_ms=wait_ms, max_records=self.settings.batch_max_records)
        except Exception as exc:
            if not is_transient(exc):
                raise
            now, backoff = time.monotonic(), self._poll_backoff
            if not backoff.failures:
                self._poll_faults_since = self._poll_warned_at = now
                log.warning("polling the Kafka broker at %s failed, retrying until it answers: %s", self.bootstrap, exc)
            elif now - self._poll_warned_at >= 30.0:
                self._poll_warned_at = now
                log.warning("the Kafka broker at %s still fails polls (%d in %.0fs), retrying: %s", self.bootstrap,
                            backoff.failures + 1, now - self._poll_faults_since, exc)
            self._stop.wait(backoff.next())
            return {}
        if records and self._poll_backoff.failures:
            log.info("the Kafka broker at %s answers again after %d failed polls in %.0fs", self.bootstrap,
                     self._poll_backoff.failures, time.monotonic() - self._poll_faults_since)
            self._poll_backoff.reset()
        return records

    def _seek_to_stored(self, consumer, assigned) -> None:
        """Seek newly assigned partitions to the offsets stored in Postgres. This runs inside the
        rebalance callback, which blocks the client's heartbeats: if Postgres does not answer within
        half the session timeout (an outage), the partitions are paused instead, so the member stays in
        the group, and the poll loop seeks and resumes them once it answers (:meth:`_seek_paused`)."""
        self._joining_since = None  # the join is done; what is left is ours to wait for
        try:
            stored = retry_transient(self._read_stored_offsets, "reading stored offsets", self._abort,
                                     self.settings.retry_max_wait_s,
                                     give_up_after_s=self.settings.session_timeout_ms / 2000)
        except Exception as exc:
            if not is_transient(exc) or self._abort.is_set():
                raise
            consumer.pause(*assigned)
            self._unseeked.update(assigned)
            self._seek_retry_at = time.monotonic()
            log.warning("partitions %s paused: their stored offsets cannot be read yet (%s); they resume when "
                        "Postgres answers", sorted(tp.partition for tp in assigned), str(exc).splitlines()[0])
            return
        self._apply_stored(consumer, assigned, stored)

    def _seek_paused(self, now: float) -> None:
        """One try (backing off between tries) at reading the stored offsets of the partitions
        :meth:`_seek_to_stored` paused; on success, seek and resume them."""
        if not self._unseeked or now < self._seek_retry_at:
            return
        try:
            stored = self._read_stored_offsets()
        except Exception as exc:
            if not is_transient(exc):
                raise
            wait_s = self._seek_backoff.next()
            self._seek_retry_at = now + wait_s
            log.debug("stored offsets still unreadable, next try in %.1fs: %s", wait_s, exc)
            return
        tps = sorted(self._unseeked)
        self._seek_backoff.reset()
        self._unseeked.clear()
        self._apply_stored(self._consumer, tps, stored)
        self._consumer.resume(*tps)

    def _check_log_ends(self) -> None:
        """Compare each assigned partition's log end (the high-water mark of the last fetch) with the
        next offset this member holds for it (``consumers.offsets``): a log that ends below it was
        re-created. Runs in the poll thread after every poll, so it checks each seek to a stored offset
        (on assignment) by the fetch that follows it, and a log re-created under a running member.
        For those partitions: let the queued batches land, read the stored offsets again, and where a
        stored offset is past the log's end, report, count, and set it back to the log's start and seek
        there (``offset_reset = earliest``) or stop the consumer (``fail``: :attr:`_fatal`).

        Raises:
            Exception: a broker or database fault that is not transient.
        """
        consumer = self._consumer
        ends = {tp: consumer.highwater(tp) for tp in consumer.assignment()}
        short = [tp for tp, end in ends.items() if end is not None and end < self._next.get(tp.partition, 0)]
        if not short:
            return
        self._drain(timeout_s=self.settings.max_poll_interval_ms / 2000)  # batches of the old log land first
        stored = self.retry(self._read_stored_offsets, "reading stored offsets")
        beyond = [tp for tp in short if stored.get(tp.partition, 0) > ends[tp]]
        starts = self.retry(lambda: consumer.beginning_offsets(beyond), "reading log starts") if beyond else {}
        found = [offsets.LogRecreated(self.topic, tp.partition, stored[tp.partition], starts.get(tp) or 0, ends[tp])
                 for tp in beyond]
        offsets.report(found, self.settings.offset_reset)
        for r in found:
            self.metrics.record_offset_reset(r.partition)
        if found and self.settings.offset_reset == "fail":
            self._fatal = offsets.OffsetBeyondLogEnd("a stored offset is past its partition's log end",
                                                     reasons=[r.describe() for r in found])
            self._stop.set()
            return
        if found:
            stored.update(self.retry(lambda: self._rewind(found), "rewinding stored offsets"))
        for tp in short:
            self._next[tp.partition] = stored.get(tp.partition, ends[tp])
            if tp in beyond:
                consumer.seek(tp, stored[tp.partition])

    def _rewind(self, found: list[offsets.LogRecreated]) -> dict[int, int]:
        with session_scope() as s:
            return offsets.rewind_to_start(s, self.group_id, found)

    def _apply_stored(self, consumer, assigned, stored: dict[int, int]) -> None:
        self._assigned_at = time.monotonic()
        for tp in assigned:
            if tp.partition in stored:
                consumer.seek(tp, stored[tp.partition])
                self._next[tp.partition] = stored[tp.partition]
            else:
                consumer.seek_to_beginning(tp)
        log.info("partitions assigned: %s (stored offsets %s)", sorted(tp.partition for tp in assigned),
                 {tp.partition: stored.get(tp.partition) for tp in assigned})

    def classify(self, messages: list[Message]) -> list[Decoded]:
        """``consumers.deadletter.classify`` each record, ``occurred_at`` judged against now (UTC)."""
        window = self.settings.time_window(datetime.now(timezone.utc))
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
                "consumers.ingest.batch", links=links,
                attributes={"messaging.system": "kafka", "messaging.destination.name": self.topic,
                            "messaging.consumer.group.name": self.group_id,
                            "messaging.batch.message_count": len(messages)}) as span:
            try:
                outcome = self.retry(lambda: self._apply(decoded), "batch transaction")
            except Exception as exc:  # noqa: BLE001
                if is_transient(exc):
                    raise
                if is_unique_violation(exc):
                    log.info("batch raced another group member for the same rows (%s); redoing it record-isolated",
                             str(exc).splitlines()[0])
                else:
                    log.warning("batch failed (%s); bisecting it to isolate the record(s) at fault", exc)
                outcome, errors = self.retry(lambda: apply_isolated(self.group_id, decoded, self.projector,
                                                                    before_commit=self._publish_dead_letters),
                                             "isolated batch transaction")
                self.stats.processing_errors += errors
            for (topic, partition), (stored, first) in outcome.offset_gaps.items():
                log.error("%s:%d: offsets %d..%d (%d records) were gone from the broker when this group read on "
                          "(retention deleted them before they were consumed): their events are not in event_log",
                          topic, partition, stored, first - 1, first - stored)
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
        """Commit to Kafka the offsets of batches the DB thread has committed."""
        offsets: dict[tuple[str, int], int] = {}
        while True:
            try:
                for k, v in self._done.get_nowait().items():
                    offsets[k] = max(offsets.get(k, 0), v)
            except queue.Empty:
                break
        if not offsets or self._consumer is None:
            return
        from kafka import TopicPartition
        from kafka.structs import OffsetAndMetadata

        for (_, p), o in offsets.items():
            self._next[p] = max(self._next.get(p, 0), o)

        def done(_offsets, result) -> None:
            if isinstance(result, Exception):  # advisory only: Postgres holds the offsets
                log.debug("kafka offset commit failed: %s", result)

        try:
            self._consumer.commit_async({TopicPartition(t, p): OffsetAndMetadata(o, "", -1)
                                         for (t, p), o in offsets.items()}, callback=done)
        except Exception as exc:  # noqa: BLE001 -- e.g. a rebalance in progress; Postgres is the truth
            log.debug("kafka offset commit refused: %s", exc)

    def _hand_over(self, item) -> None:
        """Queue a batch for the DB thread. Normally a slot frees within one batch time; if the DB
        stage is stuck (an outage being retried), keep the group membership alive with paused polls
        (no fetching, so nothing piles up) instead of being evicted after ``max_poll_interval_ms``."""
        keepalive_s = self.settings.max_poll_interval_ms / 2000
        last_poll, paused = time.monotonic(), False
        while not self._stop.is_set():
            try:
                self._work.put(item, timeout=0.1)
                break
            except queue.Full:
                if time.monotonic() - last_poll < keepalive_s:
                    continue
                if not paused:
                    self._consumer.pause(*self._consumer.assignment())
                    paused = True
                extra = self._poll(timeout_ms=0)  # keeps the member in its group; rides out a broker fault
                for tp, recs in extra.items():  # partitions assigned by a rebalance meanwhile
                    self._consumer.seek(tp, recs[0].offset)  # not taken: fetch them again later
                last_poll = time.monotonic()
        if paused:  # not those still waiting for their stored offsets
            self._consumer.resume(*(set(self._consumer.paused()) - self._unseeked))

    def _rejoin_if_stuck(self, now: float) -> None:
        """A group join that has not finished after ``join_timeout_s`` is abandoned and started over
        with a fresh client (seen on tansu after members were SIGKILLed mid-rebalance)."""
        # A healthy join may take the rebalance timeout (= max_poll_interval in kafka-python).
        timeout_s = max(self.settings.join_timeout_s, 3 * self.settings.max_poll_interval_ms / 1000)
        if self._joining_since is None or now - self._joining_since < timeout_s:
            return
        log.warning("group join not finished after %.0fs; rejoining with a new client", now - self._joining_since)
        self._drain(timeout_s=self.settings.shutdown_grace_s)
        try:
            self._consumer.close(autocommit=False)
        except Exception:  # noqa: BLE001 -- the old client is being discarded anyway
            log.debug("closing the stuck consumer failed", exc_info=True)
        self._consumer, self._unseeked = None, set()
        if self._connect():
            self._joining_since = time.monotonic()

    def _update_lag(self) -> None:
        lag = {}
        for tp in self._consumer.assignment():
            hw = self._consumer.highwater(tp)
            if hw is not None:
                lag[tp.partition] = max(0, hw - self._next.get(tp.partition, 0))
        self.metrics.set_lag(lag)

    def run(self, *, idle_exit_s: float | None = None, stop_after: int | None = None) -> IngestStats:
        """Consume until ``stop()``, ``idle_exit_s`` seconds without records, or ``stop_after`` records;
        then apply what is queued, leave the group and return the totals.

        Raises:
            Exception: a fault the DB thread could not handle (not input: input is dead-lettered).
        """
        # The poll thread is CPU-bound (decoding) while the DB thread makes ~20 short round trips per
        # batch; with the default 5 ms GIL switch interval each round trip waits up to 5 ms for the
        # GIL (measured here: 0.07 ms -> 3 ms per round trip with a busy thread). 1 ms keeps both moving.
        switch = sys.getswitchinterval()
        sys.setswitchinterval(min(switch, 0.001))
        # Each batch allocates ~50k short-lived objects that reference counting frees; at the default
        # threshold (700) the cycle collector would run ~70 times a batch, rescanning what is alive
        # (the batches in the pipeline). Freezing what start-up built and collecting young objects
        # less often took ~8% of the consumer's CPU off (bench/ingest.py).
        threshold = gc.get_threshold()
        gc.freeze()
        gc.set_threshold(50_000, *threshold[1:])
        try:
            return self._run(idle_exit_s, stop_after)
        finally:
            sys.setswitchinterval(switch)
            gc.set_threshold(*threshold)
            gc.unfreeze()

    def _run(self, idle_exit_s: float | None, stop_after: int | None) -> IngestStats:
        if not self._connect():  # stopped while reaching the broker: nothing was consumed
            self.close()
            return self.stats
        worker = threading.Thread(target=self._db_loop, name="flywheel-ingest-db", daemon=True)
        worker.start()
        last_record, polled = time.monotonic(), 0
        try:
            while not self._stop.is_set():
                self._commit_done()
                records = self._poll()
                self._check_log_ends()
                if self._fatal is not None:
                    break
                messages = [Message.from_record(r) for recs in records.values() for r in recs]
                now = time.monotonic()
                if messages:
                    if self.stats.first_record_at is None:
                        self.stats.first_record_at = now
                        log.info("first record polled at %.6f (unix s)", time.time())
                    decoded = self.classify(messages)
                    self._hand_over((messages, decoded))
                    polled += len(messages)
                    last_record = now
                self._seek_paused(now)
                self._update_lag()
                self._rejoin_if_stuck(now)
                if stop_after is not None and polled >= stop_after:
                    break
                # idle time counts from the later of the last record and the last (re)assignment
                if idle_exit_s is not None and self._assigned_at is not None and not self._work.unfinished_tasks \
                        and not self._unseeked and now - max(last_record, self._assigned_at) >= idle_exit_s:
                    break
        finally:
            self._shutdown(worker)
            self.stats.last_batch_at = time.monotonic()
            self._commit_done()
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
            log.warning("abandoning queued batches after %.0fs (they will be redelivered)",
                        self.settings.shutdown_grace_s)
            self._abort.set()
            worker.join()

    def close(self) -> None:
        """Leave the group and close clients (idempotent)."""
        if self._consumer is not None:
            try:
                self._consumer.close(autocommit=False)
            except Exception:  # noqa: BLE001 -- closing a dead connection
                log.debug("consumer close failed", exc_info=True)
            self._consumer = None
        self._dlq.close()

"""The outbox relay: publishes ``outbox`` rows to their Kafka topics, in id order, and marks them sent.

Delivery contract (at-least-once + dedupe = exactly-once effect):

- One relay publishes at a time (``pg_try_advisory_xact_lock``; a second relay finds it taken and
  returns), so messages leave in ``outbox.id`` order. Rows are claimed with
  ``SELECT ... FOR UPDATE SKIP LOCKED ORDER BY id``.
- A batch is sent, the broker's acknowledgement awaited (``acks=all``), and only then ``sent_at`` set,
  in the same transaction that claimed the rows. The idempotent producer
  (``enable_idempotence``, kafka-python >= 2.1) removes duplicates from its own retries.
- A crash between the acknowledgement and the commit leaves the rows unsent, so the next run
  publishes them again: the broker may hold a message twice. Every message therefore carries a
  stable identity fixed when the row was written — the ``event_id`` field of its JSON value (UUIDv7)
  and the ``event-id`` / ``outbox-id`` headers — and consumers dedupe on it
  (``serving/watcher.py`` does). Kafka transactions could not help here: the mark lives in
  Postgres, not in Kafka.
- Order is ``outbox.id`` order among committed rows. Ids are drawn at insert, so a long transaction
  can commit a lower id after a higher one was published; writers that need a strict order
  serialise themselves (production changes hold an advisory lock while they write), and consumers
  order by the ``outbox_id`` of those messages, not by arrival.
- If the broker refuses a message, the acknowledged prefix of the batch is still marked, the Kafka
  producer is closed and the relay raises :class:`InfrastructureError` (the loop backs off; the
  Celery task retries); the next batch starts a new producer. A batch the broker does not take in
  ``ack_timeout_s`` (``flush`` times out, or ``send`` finds no metadata) is handled the same way,
  nothing of it marked: a producer whose sends hang on a broker that restarted under it would
  otherwise time out every later batch too. An idempotent producer the broker no
  longer knows (a restarted broker: tansu keeps producer ids in memory) fails for good once its
  epoch bump is refused, so keeping it would fail every later batch (issue 54).
- The loop wakes when a transaction that wrote outbox rows commits (Postgres ``LISTEN`` on
  ``OUTBOX_CHANNEL``, :class:`OutboxWakeup`) and polls every ``interval_s`` regardless, so a
  notification lost with a dropped connection delays a message to the next poll, never loses it.

This module imports SQLAlchemy; the producer SDK (``producers``) never imports it.
"""

from __future__ import annotations

import json
import logging
import signal
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime
from types import TracebackType

import psycopg
from kafka import KafkaProducer
from kafka.errors import KafkaError
from sqlalchemy import func, make_url, select, update

from app.core.db import database_url, session_scope
from app.core.errors import InfrastructureError
from app.core.locks import AdvisoryLock
from app.core.retry import Backoff
from app.core.settings import get_settings
from app.core.telemetry import tracer
from app.models import Outbox
from app.models.events import OUTBOX_CHANNEL
from producers.settings import kafka_security

log = logging.getLogger("flywheel.relay")


def outbox_message(row: Outbox) -> tuple[bytes | None, bytes, list[tuple[str, bytes]]]:
    """Key, value and headers of the Kafka message for an outbox row (deterministic per row, so a
    re-publish is byte-identical)."""
    payload = {**row.payload, "outbox_id": row.id}
    value = json.dumps(payload, sort_keys=True, separators=(",", ":"), default=str).encode()
    headers = [(str(k), str(v).encode()) for k, v in (row.headers or [])]
    headers += [("event-type", row.event_type.encode()), ("outbox-id", str(row.id).encode())]
    if row.payload.get("event_id"):
        headers.append(("event-id", str(row.payload["event_id"]).encode()))
    return (row.key.encode() if row.key is not None else None), value, headers


class OutboxWakeup:
    """Waits for the commit of a transaction that wrote outbox rows (``NOTIFY`` on
    ``OUTBOX_CHANNEL``, sent by ``app.outbox.lifecycle``) or for a timeout, whichever comes first.

    It holds one autocommit connection of its own that LISTENs; when that connection cannot be made
    or drops, :meth:`wait` sleeps out its timeout instead (the relay then simply polls) and the next
    call connects again.
    """

    def __init__(self, url: Callable[[], str] | None = None) -> None:
        self._url = url or (
            lambda: make_url(database_url()).set(drivername="postgresql").render_as_string(hide_password=False)
        )
        self._conn: psycopg.Connection | None = None

    def wait(self, timeout_s: float) -> bool:
        """Block up to ``timeout_s`` seconds; True when a notification arrived."""
        try:
            if self._conn is None:
                self._conn = psycopg.connect(self._url(), autocommit=True, connect_timeout=5)
                self._conn.execute(f"LISTEN {OUTBOX_CHANNEL}")
            return any(True for _ in self._conn.notifies(timeout=timeout_s, stop_after=1))
        except psycopg.Error as exc:
            log.debug("outbox wake-up unavailable (%s); polling", exc)
            self.close()
            time.sleep(timeout_s)
            return False

    def close(self) -> None:
        """Close the listening connection (a later :meth:`wait` opens another)."""
        if self._conn is not None:
            try:
                self._conn.close()
            except psycopg.Error:
                pass
            self._conn = None


class OutboxRelay:
    """Publishes pending outbox rows (see module docstring).

    Args:
        bootstrap: ``host:port`` list; default ``FLYWHEEL_KAFKA_BOOTSTRAP``.
        batch_size: rows claimed per transaction.
        ack_timeout_s: seconds to wait for the broker's acknowledgement of a batch.
        after_publish: test hook called with the acknowledged row ids before they are marked
            (raising there simulates a crash between publish and mark).
    """

    def __init__(
        self,
        bootstrap: str | None = None,
        *,
        batch_size: int = 100,
        ack_timeout_s: float = 30.0,
        after_publish: Callable[[list[int]], None] | None = None,
    ) -> None:
        bootstrap = bootstrap or get_settings().kafka.bootstrap
        if not bootstrap:
            raise InfrastructureError("no broker configured: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel stack up`")
        self.bootstrap = bootstrap
        self.batch_size = batch_size
        self.ack_timeout_s = ack_timeout_s
        self.after_publish = after_publish
        self._producer: KafkaProducer | None = None
        self._stop = threading.Event()
        self._wakeup = OutboxWakeup()
        self.published = 0

    def _kafka(self) -> KafkaProducer:
        if self._producer is None:
            self._producer = KafkaProducer(
                bootstrap_servers=self.bootstrap,
                acks="all",
                enable_idempotence=True,
                retries=5,
                max_in_flight_requests_per_connection=1,
                linger_ms=0,
                client_id="flywheel-outbox-relay",
                **kafka_security(),
            )
        return self._producer

    def relay_batch(self) -> int:
        """Claim, publish and mark at most ``batch_size`` rows in one transaction. Returns rows marked
        sent (0 when nothing is pending or another relay holds the lock).

        Raises:
            InfrastructureError: the broker refused or did not acknowledge a message (the
                acknowledged prefix is still marked).
        """
        failure: Exception | None = None
        with tracer(__name__).start_as_current_span("outbox.relay_batch"), session_scope() as session:
            if not session.scalar(select(func.pg_try_advisory_xact_lock(AdvisoryLock.RELAY))):
                return 0
            rows = list(
                session.scalars(
                    select(Outbox)
                    .where(Outbox.sent_at.is_(None))
                    .order_by(Outbox.id)
                    .limit(self.batch_size)
                    .with_for_update(skip_locked=True)
                )
            )
            if not rows:
                return 0
            futures = []
            try:
                producer = self._kafka()
                for row in rows:
                    key, value, headers = outbox_message(row)
                    futures.append((row.id, producer.send(row.topic, key=key, value=value, headers=headers)))
                producer.flush(timeout=self.ack_timeout_s)
            except KafkaError as exc:  # no metadata, or no acknowledgement in time: nothing is marked
                self._close_producer()
                raise InfrastructureError(
                    f"broker did not take outbox rows {rows[0].id}..{rows[-1].id}: {exc}"
                ) from exc
            acked: list[int] = []
            for row_id, fut in futures:
                try:
                    fut.get(timeout=self.ack_timeout_s)
                except KafkaError as exc:  # stop at the first refusal: later rows must not overtake it
                    failure = exc
                    break
                acked.append(row_id)
            if self.after_publish is not None:
                self.after_publish(acked)
            if acked:
                session.execute(update(Outbox).where(Outbox.id.in_(acked)).values(sent_at=datetime.now(UTC)))
        self.published += len(acked)
        if failure is not None:
            self._close_producer()
            raise InfrastructureError(f"broker refused outbox row {futures[len(acked)][0]}: {failure}")
        return len(acked)

    def relay_pending(self, max_batches: int = 1000) -> int:
        """Publish until nothing is pending (at most ``max_batches`` batches). Returns rows published."""
        total = 0
        for _ in range(max_batches):
            n = self.relay_batch()
            total += n
            if n < self.batch_size:
                break
        return total

    def run_forever(self, interval_s: float = 2.0, max_backoff_s: float = 30.0) -> None:
        """Poll every ``interval_s`` seconds until :meth:`stop` (or SIGTERM/SIGINT in the main thread);
        back off exponentially while the broker or database is unreachable."""
        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGTERM, lambda *_: self.stop())
        backoff = Backoff(max_s=max_backoff_s, initial=interval_s)
        while not self._stop.is_set():
            try:
                n = self.relay_pending()
                if n:
                    log.info("published %d outbox message(s)", n)
                backoff.reset()
                wait_s = interval_s
            except Exception as exc:  # retry at this boundary: broker or database down for a while
                wait_s = backoff.next()
                log.warning("outbox relay failed (%s); retrying in %.1fs", exc, wait_s)
            if not self._stop.is_set():
                self._wakeup.wait(wait_s)

    def stop(self) -> None:
        """Ask :meth:`run_forever` to return after the current batch."""
        self._stop.set()

    def close(self) -> None:
        """Flush and close the Kafka producer and the wake-up connection."""
        self._wakeup.close()
        self._close_producer(timeout_s=10.0)

    def _close_producer(self, timeout_s: float = 0.0) -> None:
        """Close the Kafka producer (waiting up to ``timeout_s`` s for sends in flight); the next
        batch starts a new one."""
        producer, self._producer = self._producer, None
        if producer is None:
            return
        try:
            producer.close(timeout=timeout_s)
        except KafkaError as exc:
            # kafka-python (3.0) flushes before it closes and raises when records are still in
            # flight, leaving its sender thread retrying them; stopped here, it aborts them.
            log.warning("closing the Kafka producer with records in flight (%s): aborting them", exc)
            sender = getattr(producer, "_sender", None)
            if sender is not None:
                sender.force_close()

    def __enter__(self) -> "OutboxRelay":
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


def pending_count() -> int:
    """Outbox rows not yet marked sent."""
    with session_scope() as session:
        return session.scalar(select(func.count()).select_from(Outbox).where(Outbox.sent_at.is_(None))) or 0


def wait_until_sent(timeout_s: float = 10.0, poll_s: float = 0.1) -> bool:
    """Whether the outbox drained within ``timeout_s`` seconds (for scripts and tests)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if pending_count() == 0:
            return True
        time.sleep(poll_s)
    return False

"""The event producer SDK the product backend embeds (kafka-python; no torch, no SQLAlchemy).

Invariant: every event ``emit`` accepts is either acknowledged by the broker (``acks=all``) or
sits in the disk spool, and events of one session reach the topic in the order they were emitted.

How: ``emit`` validates and encodes the event in the caller's thread, then appends it to a bounded
in-memory FIFO; one background thread (the *sender*) drains the FIFO in batches through a
``KafkaProducer`` and waits for each batch's acknowledgements before taking the next, so a failure
is always at the head of the queue. On a broker fault the failed records and the whole in-memory
FIFO go to the *head* of the disk spool (:mod:`producers.spool`) and the producer switches to
spool mode: new events are appended to the spool's tail (not the memory FIFO) until the sender has
delivered the spool, so older events always leave first. The same happens when the memory FIFO is
full. The spool survives restarts: a new producer on the same ``spool_dir`` delivers it first.

After any fault the Kafka client is discarded and a fresh one is built on the next attempt (an
idempotent client's producer id does not survive a broker restart). Broker faults never raise into
the caller: they are counted in :attr:`EventProducer.metrics`, exported as OpenTelemetry counters,
and reported to ``on_error``. Delivery is at-least-once at the transport (a batch that timed out
may have been written); consumers deduplicate on ``event_id``.

Size: over 400 lines because the send loop, the spool hand-off and the delivery callbacks share one
ordering invariant (per-session order across broker outages) that reads best in one file.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
import weakref
from collections import deque
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from kafka import KafkaProducer
from kafka.producer.future import FutureRecordMetadata

from producers.client import DEFAULT_BATCH_BYTES, default_compression, kafka_config
from producers.errors import BrokerUnavailableError, ConfigurationError, InvalidEventError
from producers.events.codec import encode_event, validate_event
from producers.events.types import EVENT_CLASSES, EventBase
from producers.metrics import ProducerCounters
from producers.sequence import SessionSequencer
from producers.settings import KafkaSettings, flywheel_home
from producers.spool import Record, Spool
from producers.telemetry import inject_headers

log = logging.getLogger(__name__)

ErrorCallback = Callable[[Exception, EventBase | None], None]


class EventProducer:
    """Emit editor-interaction events to Kafka without ever blocking or failing the caller on the
    broker.

    Args:
        bootstrap: ``host:port[,host:port]``; default ``FLYWHEEL_KAFKA_BOOTSTRAP``.
        topic: default ``FLYWHEEL_KAFKA_INTERACTIONS_TOPIC``.
        spool_dir: disk spool root; default ``$FLYWHEEL_HOME/spool``.
        on_error: called as ``on_error(exc, None)`` from the sender thread on each broker fault,
            and as ``on_error(exc, event)`` from ``emit`` if an event had to be dropped.
        buffer_size: events held in memory before new ones go to the disk spool.
        linger_ms: extra wait (milliseconds) for a batch to fill when the FIFO is short.
        batch_max: most records per acknowledged batch.
        batch_bytes: kafka-python's per-partition batch size (bytes).
        compression: ``zstd`` | ``gzip`` | ``none``; default :func:`default_compression`.
        delivery_timeout_s: seconds before an unacknowledged record counts as failed (and spools).
        connect_timeout_s: seconds to wait for the broker when (re)connecting.
        max_backoff_s: ceiling of the exponential backoff between reconnects (seconds).
        max_event_bytes: larger encoded events are rejected with ``ValueError``; default from settings.
        spool_max_bytes: once the disk spool holds this many undelivered bytes, new events that do not
            fit in memory are dropped (counted, logged and passed to ``on_error`` as
            :class:`producers.spool.SpoolFullError`); default ``FLYWHEEL_KAFKA_SPOOL_MAX_BYTES`` (1 GiB).

    Raises:
        ConfigurationError: no bootstrap configured, or every spool lane is in use.
    """

    def __init__(
        self,
        bootstrap: str | None = None,
        topic: str | None = None,
        *,
        spool_dir: Path | None = None,
        on_error: ErrorCallback | None = None,
        buffer_size: int = 10_000,
        linger_ms: int = 5,
        batch_max: int = 2_000,
        batch_bytes: int = DEFAULT_BATCH_BYTES,
        compression: str | None = None,
        delivery_timeout_s: float = 10.0,
        connect_timeout_s: float = 5.0,
        max_backoff_s: float = 5.0,
        max_event_bytes: int | None = None,
        spool_max_bytes: int | None = None,
    ) -> None:
        kafka = KafkaSettings.load()
        self._security = kafka
        bootstrap = bootstrap or kafka.bootstrap
        if not bootstrap:
            raise ConfigurationError("no Kafka bootstrap: pass bootstrap= or set FLYWHEEL_KAFKA_BOOTSTRAP")
        self.bootstrap = bootstrap
        self.topic = topic or kafka.interactions_topic
        self.max_event_bytes = max_event_bytes or kafka.max_event_bytes
        self.compression = compression or default_compression()
        self.buffer_size, self.batch_max, self.linger_s = buffer_size, batch_max, linger_ms / 1000
        self.batch_bytes = batch_bytes
        self.delivery_timeout_s, self.connect_timeout_s = delivery_timeout_s, connect_timeout_s
        self.max_backoff_s = max_backoff_s
        self._on_error = on_error
        self._sequencer = SessionSequencer()
        self._spool = Spool(spool_dir or flywheel_home() / "spool", max_bytes=spool_max_bytes or kafka.spool_max_bytes)
        self._buffer: deque[Record] = deque()
        self._lock = threading.Lock()  # guards _buffer, _spooling, _closed and spool appends
        self._spooling = self._spool.pending > 0  # a previous process's spool goes out first
        self._closed = False
        self._counters = ProducerCounters()
        self._counts = self._counters.counts
        self._client: KafkaProducer | None = None
        self._inflight = 0
        self._down = False  # last broker attempt failed
        self._retry_at = 0.0
        self._backoff = 0.0
        self._attempts = 0  # delivery attempts concluded (flush waits for one)
        self._flushing = 0
        self._stop = False
        self._wake = threading.Event()
        self._progress = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="flywheel-producer", daemon=True)
        self._thread.start()
        atexit.register(_close_at_exit, weakref.ref(self))

    # ---- caller side ------------------------------------------------------------------------

    def emit(self, event: EventBase | Mapping[str, Any]) -> None:
        """Queue one event for delivery (keyed by ``session_id``); returns without network I/O.
        An event without ``seq`` gets its session's next one (``producers.sequence``).

        Raises:
            ValueError: (``InvalidEventError``) the event is invalid or larger than
                ``max_event_bytes`` encoded.
            RuntimeError: the producer was closed.
        """
        if isinstance(event, EventBase):
            if EVENT_CLASSES.get(event.type) is not type(event):
                self._counts["invalid"] += 1
                raise InvalidEventError("unknown_type", f"not a concrete event type: {type(event).__name__}")
            ev = event
        else:
            try:
                ev = validate_event(dict(event) if isinstance(event, Mapping) else event)
            except InvalidEventError:
                self._counts["invalid"] += 1
                raise
        stamped = self._sequencer.stamp(ev)
        value = encode_event(stamped)
        if len(value) > self.max_event_bytes:
            if stamped is not ev:
                self._sequencer.release(stamped)
            self._counts["invalid"] += 1
            raise InvalidEventError(
                "oversized",
                f"{ev.type} event {ev.event_id} is {len(value)} bytes encoded, over the limit of "
                f"{self.max_event_bytes} bytes (max_event_bytes, FLYWHEEL_KAFKA_MAX_EVENT_BYTES); it was not sent",
            )
        headers = inject_headers([("event-type", ev.type.encode())])
        rec = Record(self.topic, ev.session_id.encode(), headers, value)
        spool_error = None
        with self._lock:
            if self._closed:
                raise RuntimeError("EventProducer is closed")
            self._counts["emitted"] += 1
            if not self._spooling and len(self._buffer) < self.buffer_size:
                self._buffer.append(rec)
            else:
                # Spool mode (or memory full): the tail of the spool is the tail of the queue.
                self._spooling = True
                try:
                    self._spool.append((rec,))
                    self._counts["spooled"] += 1
                except OSError as exc:  # disk full or spool at its bound: the one case an event is dropped, loudly
                    self._counts["dropped"] += 1
                    spool_error = exc
        if spool_error is not None:
            log.error("event %s dropped: spool write failed: %s", ev.event_id, spool_error)
            self._report(spool_error, ev)
        if not self._wake.is_set():
            self._wake.set()

    @property
    def metrics(self) -> dict[str, int]:
        """Counters since start (``emitted``, ``sent``, ``spooled``, ``errors``, ``invalid``,
        ``dropped``: memory full and the spool write failed, e.g. disk full or the spool at
        ``spool_max_bytes``) and gauges (``buffered``: events in memory, ``spool_pending``: events on
        disk, ``spool_pending_bytes``, ``broker_down``)."""
        out = dict(self._counts)
        out["buffered"] = len(self._buffer) + self._inflight
        out["spool_pending"] = self._spool.pending
        out["spool_pending_bytes"] = self._spool.pending_bytes
        out["broker_down"] = int(self._down)
        return out

    def flush(self, timeout_s: float | None = None) -> None:
        """Block until every event emitted before this call is acknowledged by the broker — or,
        if a delivery attempt made after this call fails, durably spooled (fsync'd) — or
        ``timeout_s`` seconds pass. Never raises for broker faults."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        with self._lock:
            target = self._counts["sent"] + len(self._buffer) + self._inflight + self._spool.pending
        attempts = self._attempts
        with self._progress:
            self._flushing += 1
        self._retry_at = 0.0  # a flush retries a down broker now rather than after the backoff
        self._wake.set()
        try:
            with self._progress:
                while self._thread.is_alive():
                    if self._counts["sent"] >= target:
                        return
                    if self._down and self._attempts > attempts and self._durable():
                        return  # the broker refused an attempt made after this call
                    remaining = None if deadline is None else deadline - time.monotonic()
                    if remaining is not None and remaining <= 0:
                        return
                    self._progress.wait(0.2 if remaining is None else min(remaining, 0.2))
        finally:
            with self._progress:
                self._flushing -= 1

    def close(self, timeout_s: float | None = None) -> None:
        """Flush (see :meth:`flush`), then stop the sender; what is still undelivered stays in the
        spool for the next producer on the same ``spool_dir``. Idempotent."""
        with self._lock:
            if self._closed:
                return
        self.flush(timeout_s)
        with self._lock:
            self._closed = True
        self._stop = True
        self._wake.set()
        self._thread.join(self.delivery_timeout_s + self.connect_timeout_s + 5)
        with self._lock:
            leftovers, self._buffer = list(self._buffer), deque()
        if leftovers:  # sender stuck in the network: keep them, ahead of the spool
            self._spool.prepend(leftovers)
        self._spool.close()
        self._publish_metrics()

    def __enter__(self) -> "EventProducer":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- sender thread ------------------------------------------------------------------------

    def _durable(self) -> bool:
        return not self._buffer and not self._inflight and not self._spool.dirty

    def _notify(self) -> None:
        with self._progress:
            self._progress.notify_all()

    def _run(self) -> None:
        try:
            while True:
                try:
                    if self._step():
                        return
                except Exception as exc:  # e.g. a full disk: never let the sender die silently
                    log.exception("producer sender error; retrying in 1 s")
                    self._counts["errors"] += 1
                    self._report(exc)
                    self._wake.wait(1.0)
        finally:
            try:
                self._spool_buffer()
                self._spool.sync()
            finally:
                if self._client is not None:
                    self._close_client(timeout=2)
                self._notify()

    def _step(self) -> bool:
        """One turn of the sender loop; True when it should exit."""
        self._wake.clear()
        if not self._buffer and self._spool.pending == 0:
            with self._lock:  # leave spool mode only when both queues are empty
                if not self._buffer and self._spool.pending == 0:
                    self._spooling = False
            self._spool.sync()
            self._publish_metrics()
            self._notify()
            if self._stop:
                return True
            self._wake.wait(0.5)
            return False
        if self._stop and (self._down or not self._flushing):
            return True  # close(): flush already gave delivery its chance
        if self._down and time.monotonic() < self._retry_at:
            self._spool_buffer()
            self._spool.sync()
            self._publish_metrics()
            self._notify()
            self._wake.wait(min(0.2, max(0.0, self._retry_at - time.monotonic())))
            return False
        self._deliver_next()
        self._publish_metrics()
        self._notify()
        return False

    def _spool_buffer(self) -> None:
        """Move the memory FIFO to the head of the spool (it is older than anything spooled)."""
        with self._lock:
            records, self._buffer = list(self._buffer), deque()
            if records:
                self._spooling = True
                self._counts["spooled"] += len(records)
                self._inflight += len(records)  # in neither queue until the prepend returns
        if records:
            try:
                self._spool.prepend(records)
            except OSError:
                self._requeue_front(records)
                raise
            finally:
                self._inflight -= len(records)

    def _requeue_front(self, records: list[Record]) -> None:
        """Put records that could not be spooled back at the head of the memory FIFO."""
        with self._lock:
            self._buffer.extendleft(reversed(records))

    def _deliver_next(self) -> None:
        if self._client is None:
            try:
                self._client = self._connect()
            except Exception as exc:  # NoBrokersAvailable, timeouts, ... all mean "broker down"
                self._fault(exc)
                return
        if self._buffer:
            if self.linger_s and len(self._buffer) < self.batch_max and not self._flushing and not self._stop:
                time.sleep(self.linger_s)
            with self._lock:
                n = min(len(self._buffer), self.batch_max)
                records = [self._buffer.popleft() for _ in range(n)]
            token = None
        else:
            records, token = self._spool.read(self.batch_max)
            if not records:
                return
        self._inflight = len(records)
        failed, error = self._send(self._client, records)
        if token is not None:
            if failed:
                self._spool.prepend(failed)
            self._spool.commit(token)
        elif failed:
            with self._lock:
                rest, self._buffer = list(self._buffer), deque()
                self._spooling = True
                self._counts["spooled"] += len(failed) + len(rest)
                self._inflight += len(rest)
            try:
                self._spool.prepend(failed + rest)
            except OSError:
                self._inflight = 0
                self._requeue_front(failed + rest)
                raise
        self._counts["sent"] += len(records) - len(failed)
        self._inflight = 0
        if failed:
            self._fault(error or RuntimeError(f"{len(failed)} records not acknowledged"))
        else:
            self._down, self._backoff = False, 0.0
            self._attempts += 1

    def _send(self, client: KafkaProducer, records: list[Record]) -> tuple[list[Record], Exception | None]:
        """Send a batch and wait for its acknowledgements. Returns the records not acknowledged."""
        futures: list[FutureRecordMetadata] = []
        error: Exception | None = None
        try:
            for r in records:
                futures.append(client.send(r.topic, value=r.value, key=r.key, headers=r.headers))
        except Exception as exc:  # metadata timeout and friends: the rest of the batch is unsent
            error = exc
        try:
            client.flush(timeout=self.delivery_timeout_s + 5)
        except Exception as exc:
            error = error or exc
        failed = [r for r, f in zip(records, futures) if not (f.is_done and f.succeeded())]
        failed += records[len(futures) :]
        if failed and error is None:
            error = next((f.exception for f in futures if f.is_done and f.failed()), None)
        return failed, error

    def _connect(self) -> KafkaProducer:
        return KafkaProducer(
            **kafka_config(
                self.bootstrap,
                compression=self.compression,
                linger_ms=int(self.linger_s * 1000),
                batch_bytes=self.batch_bytes,
                max_event_bytes=self.max_event_bytes,
                delivery_timeout_s=self.delivery_timeout_s,
                connect_timeout_s=self.connect_timeout_s,
                security=self._security.security_config(),
            )
        )

    def _close_client(self, timeout: float = 0) -> None:
        client, self._client = self._client, None
        if client is None:
            return
        try:
            client.close(timeout=timeout)
        except Exception:  # closing a broken client can fail in many ways; it is discarded anyway
            log.debug("closing kafka client failed", exc_info=True)

    def _fault(self, exc: Exception) -> None:
        """A broker fault: drop the client, back off exponentially, report."""
        if self._client is not None:
            self._close_client()
        self._counts["errors"] += 1
        self._down = True
        self._backoff = min(self.max_backoff_s, max(0.25, self._backoff * 2))
        self._retry_at = time.monotonic() + self._backoff
        self._attempts += 1
        if self._security.security_protocol != "PLAINTEXT" and not isinstance(exc, BrokerUnavailableError):
            # kafka-python reports refused credentials as a bootstrap timeout: say what to check
            reported = BrokerUnavailableError(
                f"the broker at {self.bootstrap} did not take the records ({type(exc).__name__}: {exc}); it is "
                f"down or refused the connection's security ({self._security.security_summary()})"
            )
            reported.__cause__ = exc
            exc = reported
        log.warning("broker fault (%s: %s); spooling, retry in %.2fs", type(exc).__name__, exc, self._backoff)
        self._report(exc)

    def _report(self, exc: Exception, event: EventBase | None = None) -> None:
        if self._on_error is not None:
            try:
                self._on_error(exc, event)
            except Exception:  # the callback is the caller's code: never let it kill the sender
                log.exception("EventProducer on_error callback raised")

    def _publish_metrics(self) -> None:
        self._counters.publish()


def _close_at_exit(ref: "weakref.ReferenceType[EventProducer]") -> None:
    producer = ref()
    if producer is not None:
        producer.close(timeout_s=10)

"""The serving front follows the lifecycle topic: canary starts and stops change its routing, every
production change makes it re-read what the servers serve.

Invariants:

- the topic is read over ALL its partitions by manual assignment (no consumer group), like the
  serving watcher: every front replica sees every change;
- at start the front seeks to the topic's end, THEN reads the active canary from the database, then
  applies what arrives after those positions, so no change between the two reads is missed; without
  a database it replays the topic from its beginning instead (the newest canary change wins);
- canary changes apply in ``outbox_id`` order and one not newer than the last applied is ignored
  (the relay is at-least-once); a ``canary.stopped`` stops only the canary it names;
- nothing here moves weights or reads a checkpoint from a message: the router re-reads the
  servers' weight versions after each change (:meth:`serving.front_routing.FrontRouter.invalidate`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import Any

from kafka import KafkaConsumer, TopicPartition

from app.core.db import session_scope
from app.core.retry import Backoff
from app.lifecycle.canary import get_active_canary
from app.lifecycle.messages import (
    CANARY_CHANGES,
    PRODUCTION_CHANGES,
    LifecycleMessageError,
    parse_lifecycle_message,
)
from serving.front_routing import Canary, FrontRouter

log = logging.getLogger("flywheel.front")


def canary_from_registry() -> Canary | None:
    """The active canary as the database has it (None when none is active).

    Raises:
        sqlalchemy.exc.SQLAlchemyError: the database is unreachable or errs.
    """
    with session_scope() as session:
        row = get_active_canary(session)
        if row is None:
            return None
        return Canary(canary_id=str(row.id), checkpoint_id=row.checkpoint_id, fraction=float(row.fraction))


class LifecycleFollower:
    """Applies lifecycle messages to a :class:`FrontRouter`; :meth:`start` reads them from Kafka in
    a daemon thread (see the module invariants).

    Args:
        router: the routing state to change.
        bootstrap: the broker (``host:port``); None: the front follows nothing and says so.
        topic: the lifecycle topic.
    """

    def __init__(self, router: FrontRouter, *, bootstrap: str | None, topic: str) -> None:
        self.router = router
        self.bootstrap = bootstrap
        self.topic = topic
        self.applied_outbox_id = 0
        self.positions: dict[int, int] = {}  # partition -> next offset, so a reconnect resumes there
        self._from_beginning = False
        self._consumer: KafkaConsumer | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def apply(self, payloads: Iterable[dict[str, Any]]) -> Canary | None:
        """Apply a batch of decoded lifecycle messages in ``outbox_id`` order; returns the canary routed to."""
        for payload in sorted(payloads, key=lambda p: p.get("outbox_id") or 0):
            kind = payload.get("type")
            if kind in PRODUCTION_CHANGES:
                self.router.invalidate()
                log.info("%s %s: re-reading what the servers serve", kind, payload.get("checkpoint_id"))
                continue
            if kind not in CANARY_CHANGES or not payload.get("canary_id"):
                continue
            outbox_id = payload.get("outbox_id")
            if isinstance(outbox_id, int):
                if outbox_id <= self.applied_outbox_id:
                    continue
                self.applied_outbox_id = outbox_id
            canary_id = str(payload["canary_id"])
            if kind == "canary.started":
                try:
                    canary = Canary(canary_id, str(payload["checkpoint_id"]), float(payload["fraction"]))
                except (KeyError, TypeError, ValueError):
                    log.error("ignoring a canary.started without checkpoint_id and fraction: %s", payload)
                    continue
                self.router.set_canary(canary)
                log.info("canary %s: %s for %.1f%% of users", canary_id, canary.checkpoint_id, 100 * canary.fraction)
            elif self.router.canary is not None and self.router.canary.canary_id == canary_id:
                self.router.set_canary(None)
                log.info("canary %s stopped: production serves every user", canary_id)
        return self.router.canary

    def _connect(self, *, from_beginning: bool) -> KafkaConsumer:
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            group_id=None,
            client_id="flywheel-serving-front",
        )
        partitions = consumer.partitions_for_topic(self.topic) or {0}
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        for tp in tps:
            if tp.partition in self.positions:
                consumer.seek(tp, self.positions[tp.partition])
            elif from_beginning:
                consumer.seek_to_beginning(tp)
            else:
                consumer.seek_to_end(tp)
            self.positions[tp.partition] = consumer.position(tp)  # resolved now, before the registry is read
        return consumer

    def begin(self) -> Canary | None:
        """Take the starting state: positions at the topic's end, then the database's active canary
        (the topic from its beginning when the database cannot be read). Never raises: a broker that
        is down is connected to later by the thread, a database that is down is logged."""
        from_beginning = False
        if self.bootstrap:
            try:
                self._consumer = self._connect(from_beginning=False)
            except Exception as exc:  # the broker is down: the thread connects once it is back
                log.warning("lifecycle topic unreachable at start (%s); following it once it answers", exc)
        try:
            self.router.set_canary(canary_from_registry())
        except Exception as exc:  # no registry: the topic's own history says which canary runs
            log.error("no active canary read from the database (%s); replaying the lifecycle topic", exc)
            from_beginning = True
            if self._consumer is not None:
                self._consumer.seek_to_beginning()
                self.positions.clear()
        self._from_beginning = from_beginning
        return self.router.canary

    def poll_once(self, timeout_ms: int = 1000) -> int:
        """Read and apply one batch; returns how many messages it held.

        Raises:
            kafka.errors.KafkaError: the broker failed (the caller reconnects).
        """
        if self._consumer is None:
            self._consumer = self._connect(from_beginning=self._from_beginning)
        records = self._consumer.poll(timeout_ms=timeout_ms, max_records=500)
        payloads = []
        for tp, msgs in records.items():
            for m in msgs:
                self.positions[tp.partition] = m.offset + 1
                try:  # the one typed parse every follower shares (app.lifecycle.messages)
                    payloads.append(parse_lifecycle_message(m.value).model_dump(mode="json"))
                except LifecycleMessageError as exc:
                    log.warning("skipping lifecycle message %s:%s: %s", tp.partition, m.offset, exc)
        self.apply(payloads)
        return sum(len(msgs) for msgs in records.values())

    def run(self) -> None:
        """Poll until :meth:`stop`; a broker fault is logged and retried (1 s doubling, at most 30 s)
        while the front keeps routing by what it knows."""
        backoff = Backoff(30.0, initial=1.0)
        while not self._stop.is_set():
            try:
                self.poll_once()
                backoff.reset()
            except Exception as exc:
                wait_s = backoff.next()
                log.warning("following the lifecycle topic failed (%s); retrying in %.0fs", exc, wait_s)
                if self._consumer is not None:
                    self._consumer.close()
                    self._consumer = None
                self._stop.wait(wait_s)

    def start(self) -> None:
        """Follow the topic in a daemon thread (no-op without a broker configured)."""
        if not self.bootstrap:
            log.warning("no broker configured (FLYWHEEL_KAFKA_BOOTSTRAP): the front follows no lifecycle changes")
            return
        self._thread = threading.Thread(target=self.run, name="front-lifecycle", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop following and close the consumer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None

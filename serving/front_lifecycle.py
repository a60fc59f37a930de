"""The serving front follows the lifecycle topic: canary starts and stops change its routing, every
production change makes it re-read what the servers serve.

Invariants:

- the topic is read by the follower the serving watcher uses too (:mod:`serving.lifecycle_topic`:
  all partitions, typed messages, positions advanced after a batch is applied); every front
  replica sees every change;
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
from collections.abc import Iterable

from app.core.db import session_scope
from app.core.errors import InfrastructureError
from app.lifecycle.canary import get_active_canary
from app.lifecycle.messages import CanaryStarted, CanaryStopped, LifecycleMessage, ProductionChanged
from serving.front_routing import Canary, FrontRouter
from serving.lifecycle_topic import LifecycleBatch, LifecycleTopicFollower

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
    a daemon thread through a :class:`serving.lifecycle_topic.LifecycleTopicFollower` (see the
    module invariants).

    Args:
        router: the routing state to change.
        bootstrap: the broker (``host:port``); None: the front follows nothing and says so.
        topic: the lifecycle topic.
    """

    def __init__(self, router: FrontRouter, *, bootstrap: str | None, topic: str) -> None:
        self.router = router
        self.applied_outbox_id = 0
        self.topic_follower = (
            LifecycleTopicFollower(
                self._apply_batch,
                bootstrap=bootstrap,
                topic=topic,
                client_id="flywheel-serving-front",
                start_at="end",
            )
            if bootstrap
            else None
        )

    def apply(self, messages: Iterable[LifecycleMessage]) -> Canary | None:
        """Apply a batch of lifecycle messages in ``outbox_id`` order; returns the canary routed to."""
        for message in sorted(messages, key=lambda m: m.outbox_id or 0):
            if isinstance(message, ProductionChanged):
                self.router.invalidate()
                log.info("%s %s: re-reading what the servers serve", message.type, message.checkpoint_id)
                continue
            if not isinstance(message, CanaryStarted | CanaryStopped):
                continue
            if message.outbox_id is not None:
                if message.outbox_id <= self.applied_outbox_id:
                    continue
                self.applied_outbox_id = message.outbox_id
            if isinstance(message, CanaryStarted):
                canary = Canary(message.canary_id, message.checkpoint_id, message.fraction)
                self.router.set_canary(canary)
                log.info(
                    "canary %s: %s for %.1f%% of users", canary.canary_id, canary.checkpoint_id, 100 * canary.fraction
                )
            elif self.router.canary is not None and self.router.canary.canary_id == message.canary_id:
                self.router.set_canary(None)
                log.info("canary %s stopped: production serves every user", message.canary_id)
        return self.router.canary

    def _apply_batch(self, batch: LifecycleBatch) -> None:
        self.apply(r.message for r in batch.records)

    def begin(self) -> Canary | None:
        """Take the starting state: positions at the topic's end, then the database's active canary
        (the topic from its beginning when the database cannot be read). Never raises: a broker that
        is down is connected to later by the thread, a database that is down is logged."""
        if self.topic_follower is not None:
            try:
                self.topic_follower.connect()
            except Exception as exc:  # the broker is down: the thread connects once it is back
                log.warning("lifecycle topic unreachable at start (%s); following it once it answers", exc)
        try:
            self.router.set_canary(canary_from_registry())
        except Exception as exc:  # no registry: the topic's own history says which canary runs
            log.error("no active canary read from the database (%s); replaying the lifecycle topic", exc)
            if self.topic_follower is not None:
                self.topic_follower.replay_from_beginning()
        return self.router.canary

    def poll_once(self, timeout_ms: int = 1000) -> int:
        """Read and apply one batch; returns how many messages it held.

        Raises:
            InfrastructureError: no broker is configured.
            kafka.errors.KafkaError: the broker failed (the caller reconnects).
        """
        if self.topic_follower is None:
            raise InfrastructureError("no broker configured (FLYWHEEL_KAFKA_BOOTSTRAP): no lifecycle topic to read")
        return self.topic_follower.poll_once(timeout_ms)

    def start(self) -> None:
        """Follow the topic in a daemon thread (no-op without a broker configured)."""
        if self.topic_follower is None:
            log.warning("no broker configured (FLYWHEEL_KAFKA_BOOTSTRAP): the front follows no lifecycle changes")
            return
        self.topic_follower.start("front-lifecycle")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop following and close the consumer."""
        if self.topic_follower is not None:
            self.topic_follower.stop(timeout_s)

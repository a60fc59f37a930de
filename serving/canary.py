"""Serving a canary beside production in the watcher: the router that holds the canary engine, and
the follower that builds and drops it on ``canary.started`` / ``canary.stopped``.

Invariants:

- a user's arm is ``app.lifecycle.assignment.assign_arm(user_id, canary_id, fraction)`` (sha256,
  sticky for the whole canary), the same function the serving front (:mod:`serving.front`) and
  any analysis use; production traffic is split there, by the front, never here;
- the router swaps (production engine, canary engine, canary) under one lock, so a caller never
  gets a canary engine for a canary that has stopped;
- the canary engine comes from the one engine factory (:func:`serving.engine.setup_engine`, role
  ``canary``): on vLLM the server at ``FLYWHEEL_SERVING_CANARY_URL`` or the managed ``canary`` server
  (:mod:`serving.canary_server`), the reference engine in-process;
- a canary that cannot be served (vLLM missing, the server failed to start) is logged as an error
  and leaves every user on production: the watcher goes on, and the front, which routes a canary's
  users only to a server reporting the canary's checkpoint, keeps them on production;
- only the newest canary change of a batch acts (at most one canary is active, so the newest
  message alone says what serves), and one whose ``outbox_id`` is not newer than the last applied
  is ignored (the relay is at-least-once).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from app.checkpoints.store import STABLE, CheckpointStore
from app.core.errors import ConfigurationError, InfrastructureError
from app.lifecycle.assignment import CANARY, assign_arm
from app.lifecycle.messages import CanaryStarted, CanaryStopped, LifecycleMessage
from serving.engine import setup_engine

log = logging.getLogger("flywheel.canary")


@dataclass(frozen=True)
class ActiveCanary:
    """The canary the router serves: ``checkpoint_id`` for users whose arm hash is below ``fraction``."""

    canary_id: str
    checkpoint_id: str
    fraction: float
    path: str | None = None


class EngineRouter:
    """Holds the production engine and, while a canary runs, the canary engine; picks per user.

    Args:
        production: the engine serving the production checkpoint.
    """

    def __init__(self, production) -> None:
        self._lock = threading.Lock()
        self.production = production
        self._canary_engine = None
        self.active: ActiveCanary | None = None

    def arm_for(self, user_id: str) -> str:
        """``"canary"`` or ``"production"`` for this user under the active canary."""
        with self._lock:
            active = self.active
        return "production" if active is None else assign_arm(user_id, active.canary_id, active.fraction)

    def engine_for(self, user_id: str):
        """The engine that serves this user's sessions now."""
        with self._lock:
            if self.active is not None and assign_arm(user_id, self.active.canary_id, self.active.fraction) == CANARY:
                return self._canary_engine
            return self.production

    def replace(self, active: ActiveCanary | None, engine):
        """Route ``active.fraction`` of users to ``engine`` (``None``, ``None``: every user on
        production). Returns the previous canary engine, not closed: sessions may still run on it."""
        with self._lock:
            old, self._canary_engine, self.active = self._canary_engine, engine, active
        return None if old is engine else old

    def start(self, active: ActiveCanary, engine) -> None:
        """Route ``active.fraction`` of users to ``engine`` (replacing any previous canary, closed)."""
        old = self.replace(active, engine)
        if old is not None:
            old.close()

    def stop(self) -> None:
        """Every user back on production; the canary engine is closed."""
        old = self.replace(None, None)
        if old is not None:
            old.close()

    @property
    def canary_engine(self):
        """The canary engine, None without a canary."""
        with self._lock:
            return self._canary_engine


EngineFactory = Callable[[str, Path], Any]


def _canary_engine(checkpoint_id: str, path: Path) -> Any:
    return setup_engine(checkpoint_id=checkpoint_id, model_dir=path, role="canary")


class CanaryFollower:
    """Applies canary changes from the lifecycle topic to an :class:`EngineRouter` (no Kafka here).

    Args:
        router: the router to start and stop canaries on.
        store: where checkpoints live when a message's path does not resolve.
        factory: builds the canary engine from ``(checkpoint_id, folder)`` (default
            :func:`serving.engine.setup_engine` in the ``canary`` role).
    """

    def __init__(
        self, router: EngineRouter, *, store: CheckpointStore | None = None, factory: EngineFactory | None = None
    ) -> None:
        self.router = router
        self.store = store or CheckpointStore.from_settings()
        self.factory = factory or _canary_engine
        self.applied_outbox_id = 0

    def accept(self, message: LifecycleMessage) -> bool:
        """Whether a message is a canary change newer than the last one applied."""
        if not isinstance(message, CanaryStarted | CanaryStopped):
            return False
        return not (message.outbox_id is not None and message.outbox_id <= self.applied_outbox_id)

    def _folder(self, message: CanaryStarted) -> Path:
        if message.path and (Path(message.path) / STABLE).exists():
            return Path(message.path)
        return self.store.stable_path(message.checkpoint_id)

    def _start(self, active: ActiveCanary, folder: Path) -> None:
        """Build the canary engine and route to it; one that cannot be built is logged as an error
        and leaves every user on production (the previous canary engine, if any, is closed)."""
        try:
            engine = self.factory(active.checkpoint_id, folder)
        except (ConfigurationError, InfrastructureError) as exc:
            self.router.stop()
            log.error(
                "canary %s (%s) cannot be served, production serves every user: %s",
                active.canary_id,
                active.checkpoint_id,
                exc,
            )
            return
        self.router.start(active, engine)
        log.info("canary %s: %s serves %.1f%% of users", active.canary_id, active.checkpoint_id, 100 * active.fraction)

    def apply(self, message: CanaryStarted | CanaryStopped) -> ActiveCanary | None:
        """Start (build the canary engine, then route) or stop the message's canary.

        Raises:
            CheckpointError: the canary's directory is not available here (the caller retries).
        """
        if isinstance(message, CanaryStarted):
            folder = self._folder(message)
            active = ActiveCanary(
                canary_id=message.canary_id,
                checkpoint_id=message.checkpoint_id,
                fraction=message.fraction,
                path=str(folder),
            )
            self._start(active, folder)
        elif self.router.active is not None and self.router.active.canary_id == message.canary_id:
            self.router.stop()
            log.info("canary %s stopped: production serves every user", message.canary_id)
        if message.outbox_id is not None:
            self.applied_outbox_id = max(self.applied_outbox_id, message.outbox_id)
        return self.router.active

    def handle(self, messages: Sequence[LifecycleMessage]) -> ActiveCanary | None:
        """Apply the newest accepted canary change among ``messages`` (see module invariants)."""
        accepted = [m for m in messages if isinstance(m, CanaryStarted | CanaryStopped) and self.accept(m)]
        if not accepted:
            return self.router.active
        return self.apply(max(accepted, key=lambda m: m.outbox_id or 0))

    def state(self) -> dict[str, Any]:
        """What ``serving.json`` keeps so a restarted watcher serves the same canary."""
        active = self.router.active
        return {"canary": asdict(active) if active else None, "applied_canary_outbox_id": self.applied_outbox_id}

    def restore(self, state: dict[str, Any]) -> None:
        """Rebuild the canary a previous run reported in ``serving.json`` (no-op without one)."""
        self.applied_outbox_id = int(state.get("applied_canary_outbox_id") or 0)
        saved = state.get("canary")
        if saved:
            active = ActiveCanary(**saved)
            folder = Path(active.path) if active.path else self.store.stable_path(active.checkpoint_id)
            self._start(active, folder)

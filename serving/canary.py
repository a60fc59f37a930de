"""Serving a canary beside production: the engine router that picks an arm per user, the
follower that starts and stops the canary engine on ``canary.started`` / ``canary.stopped``, and
the router production traffic uses, which follows what the serving watcher serves.

Invariants:

- a user's arm is ``app.lifecycle.assignment.assign_arm(user_id, canary_id, fraction)`` (sha256,
  sticky for the whole canary), the same function the simulator and any analysis use;
- the router swaps (production engine, canary engine, canary) under one lock, so a caller never
  gets a canary engine for a canary that has stopped;
- the canary engine is a second weight set: a second in-process ``TorchEngine`` for the torch
  engine; for vLLM a second server (``FLYWHEEL_SERVING_CANARY_URL``, loaded with the canary
  checkpoint by the follower) or a model name a routing layer already serves the candidate under
  (``FLYWHEEL_SERVING_CANARY_MODEL`` on the production URL; nothing is reloaded then);
- production traffic routes by what the serving watcher reports it serves (:class:`TrafficRouter`
  over ``serving.json``), so a canary stopped by anyone, the canary policy included, stops getting
  users within seconds of the watcher applying ``canary.stopped``;
- only the newest canary change of a batch acts (at most one canary is active, so the newest
  message alone says what serves), and one whose ``outbox_id`` is not newer than the last applied
  is ignored (the relay is at-least-once).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from pydantic_settings import BaseSettings, SettingsConfigDict

from app.checkpoints.store import STABLE, CheckpointStore
from app.core.db import session_scope
from app.core.errors import CheckpointError, ConfigurationError, InfrastructureError
from app.core.settings import flywheel_home, get_settings
from app.lifecycle.assignment import CANARY, assign_arm
from app.lifecycle.canary import get_active_canary
from app.lifecycle.messages import CANARY_CHANGES
from app.lifecycle.serving_state import read_serving_state
from app.models import Checkpoint

log = logging.getLogger("flywheel.canary")


class CanaryServingSettings(BaseSettings):
    """Where a canary is served with the vLLM engine (``FLYWHEEL_SERVING_CANARY_*``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SERVING_CANARY_", extra="ignore")
    url: str | None = None
    """Base URL of a second OpenAI-compatible server the follower loads the canary checkpoint into."""
    model: str | None = None
    """Served model name of the candidate (on ``url``, or on the production server when ``url`` is unset)."""


def canary_settings() -> CanaryServingSettings:
    """The ``FLYWHEEL_SERVING_CANARY_*`` settings (environment, then the local stack's env file)."""
    return CanaryServingSettings(_env_file=(flywheel_home() / "stack.env",))  # type: ignore[call-arg]


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


def setup_canary_engine(checkpoint_id: str, path: Path, settings=None, canary: CanaryServingSettings | None = None):
    """A second engine serving ``checkpoint_id`` (see the module invariants for vLLM).

    Raises:
        ConfigurationError: vLLM without ``FLYWHEEL_SERVING_CANARY_URL`` or ``_MODEL``.
    """
    settings = settings or get_settings()
    canary = canary or canary_settings()
    if settings.serving.engine == "torch":
        from serving.torch_engine import TorchEngine

        return TorchEngine(path, checkpoint_id=checkpoint_id)
    from serving.openai_engine import OpenAICompatEngine

    if not canary.url and not canary.model:
        raise ConfigurationError(
            "a canary on vLLM needs FLYWHEEL_SERVING_CANARY_URL (a second server) or "
            "FLYWHEEL_SERVING_CANARY_MODEL (the candidate's served model name)"
        )
    key = settings.serving.api_key.get_secret_value() if settings.serving.api_key else None
    engine = OpenAICompatEngine(canary.url or settings.serving.url, api_key=key, model=canary.model)
    if canary.url and engine.checkpoint_id != checkpoint_id:
        engine.load_checkpoint(checkpoint_id, path)
    engine.checkpoint_id = checkpoint_id
    return engine


EngineFactory = Callable[[str, Path], Any]


class CanaryFollower:
    """Applies canary changes from the lifecycle topic to an :class:`EngineRouter` (no Kafka here).

    Args:
        router: the router to start and stop canaries on.
        store: where checkpoints live when a message's path does not resolve.
        factory: builds the canary engine from ``(checkpoint_id, folder)`` (default
            :func:`setup_canary_engine`).
    """

    def __init__(
        self, router: EngineRouter, *, store: CheckpointStore | None = None, factory: EngineFactory | None = None
    ) -> None:
        self.router = router
        self.store = store or CheckpointStore.from_settings()
        self.factory = factory or setup_canary_engine
        self.applied_outbox_id = 0

    def accept(self, payload: dict[str, Any]) -> bool:
        """Whether a message is a canary change newer than the last one applied."""
        if payload.get("type") not in CANARY_CHANGES or not payload.get("canary_id"):
            return False
        outbox_id = payload.get("outbox_id")
        return not (isinstance(outbox_id, int) and outbox_id <= self.applied_outbox_id)

    def _folder(self, payload: dict[str, Any]) -> Path:
        path = payload.get("path")
        if path and (Path(path) / STABLE).exists():
            return Path(path)
        return self.store.stable_path(payload["checkpoint_id"])

    def apply(self, payload: dict[str, Any]) -> ActiveCanary | None:
        """Start (build the canary engine, then route) or stop the message's canary.

        Raises:
            CheckpointError: the canary's directory is not available here (the caller retries).
        """
        if payload["type"] == "canary.started":
            folder = self._folder(payload)
            active = ActiveCanary(
                canary_id=str(payload["canary_id"]),
                checkpoint_id=payload["checkpoint_id"],
                fraction=float(payload["fraction"]),
                path=str(folder),
            )
            self.router.start(active, self.factory(active.checkpoint_id, folder))
            log.info(
                "canary %s: %s serves %.1f%% of users", active.canary_id, active.checkpoint_id, 100 * active.fraction
            )
        elif self.router.active is not None and self.router.active.canary_id == str(payload["canary_id"]):
            self.router.stop()
            log.info("canary %s stopped: production serves every user", payload["canary_id"])
        if isinstance(payload.get("outbox_id"), int):
            self.applied_outbox_id = max(self.applied_outbox_id, payload["outbox_id"])
        return self.router.active

    def handle(self, payloads: Sequence[dict[str, Any]]) -> ActiveCanary | None:
        """Apply the newest accepted canary change among ``payloads`` (see module invariants)."""
        accepted = [p for p in payloads if self.accept(p)]
        if not accepted:
            return self.router.active
        return self.apply(max(accepted, key=lambda p: p.get("outbox_id") or 0))

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
            self.router.start(active, self.factory(active.checkpoint_id, folder))


def served_canary(home: Path | None = None) -> ActiveCanary | None:
    """The canary the serving watcher reports it serves (``serving.json``, written once the canary
    engine is built, cleared on ``canary.stopped``); the registry's active canary when no watcher
    has reported here."""
    state = read_serving_state(home)
    if state is None or "canary" not in state:
        return active_canary_from_registry()
    return ActiveCanary(**state["canary"]) if state["canary"] else None


class TrafficRouter:
    """The per-user engine choice production traffic uses: the serving watcher's routing.

    It follows :func:`served_canary` (re-read at most every ``refresh_s`` seconds, on the calls of
    :meth:`engine_for`): a canary the watcher started gets its share of users, a canary it stopped
    (by a release manager, the canary policy, a production change or an erasure) sends them back
    to production from their next session. A replaced canary engine is closed by :meth:`close`,
    once the sessions that may run on it are over.

    Args:
        production: the engine serving the production checkpoint.
        factory: builds the canary engine from ``(checkpoint_id, folder)`` (default
            :func:`setup_canary_engine`).
        home: where ``serving.json`` lives (default ``$FLYWHEEL_HOME``).
        refresh_s: most seconds a change of the reported canary takes to reach traffic.
    """

    def __init__(
        self, production, *, factory: EngineFactory | None = None, home: Path | None = None, refresh_s: float = 2.0
    ) -> None:
        self.router = EngineRouter(production)
        self.factory = factory or setup_canary_engine
        self.home = home
        self.refresh_s = refresh_s
        self._refresh_lock = threading.Lock()
        self._read_at: float | None = None
        self._retired: list[Any] = []

    @property
    def active(self) -> ActiveCanary | None:
        """The canary traffic is routed to now."""
        return self.router.active

    def refresh(self, *, force: bool = False) -> ActiveCanary | None:
        """Re-read the served canary if due (or ``force``) and route by it. A canary engine that
        cannot be built yet (its folder not synced, its server down) leaves every user on
        production and is tried again at the next refresh."""
        if not self._refresh_lock.acquire(blocking=force):
            return self.router.active  # another thread refreshes: route by what is there
        try:
            now = time.monotonic()
            if not force and self._read_at is not None and now - self._read_at < self.refresh_s:
                return self.router.active
            self._read_at = now
            wanted, current = served_canary(self.home), self.router.active
            if (wanted and wanted.canary_id) == (current and current.canary_id):
                return current
            engine = None
            if wanted is not None:
                try:
                    folder = (
                        Path(wanted.path)
                        if wanted.path
                        else CheckpointStore.from_settings().stable_path(wanted.checkpoint_id)
                    )
                    engine = self.factory(wanted.checkpoint_id, folder)
                except (CheckpointError, InfrastructureError) as exc:
                    log.warning(
                        "canary %s cannot be served yet (%s): production serves everyone", wanted.canary_id, exc
                    )
                    wanted = None
            if wanted is None and current is None:
                return None
            old = self.router.replace(wanted, engine)
            if old is not None:
                self._retired.append(old)
            log.info(
                "traffic: %s",
                f"canary {wanted.canary_id} ({wanted.checkpoint_id}) serves {wanted.fraction:.1%} of users"
                if wanted
                else "production serves every user",
            )
            return wanted
        finally:
            self._refresh_lock.release()

    def engine_for(self, user_id: str):
        """The engine that serves this user's next session."""
        self.refresh()
        return self.router.engine_for(user_id)

    def close(self) -> None:
        """Close the canary engines this router built (call when the traffic it routed is over)."""
        self.router.stop()
        for engine in self._retired:
            engine.close()
        self._retired.clear()


def active_canary_from_registry() -> ActiveCanary | None:
    """The active canary as the registry has it (for processes that do not follow the lifecycle
    topic, e.g. ``flywheel simulate``), with its checkpoint's folder; None when none is active."""
    with session_scope() as session:
        row = get_active_canary(session)
        if row is None:
            return None
        path = session.get(Checkpoint, row.checkpoint_id).path
        return ActiveCanary(canary_id=str(row.id), checkpoint_id=row.checkpoint_id, fraction=row.fraction, path=path)

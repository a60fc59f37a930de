"""Serving a canary beside production: the engine router the watcher keeps the canary engine in,
the follower that starts and stops the canary engine on ``canary.started`` / ``canary.stopped``, and
the managed canary vLLM server.

Invariants:

- a user's arm is ``app.lifecycle.assignment.assign_arm(user_id, canary_id, fraction)`` (sha256,
  sticky for the whole canary), the same function the serving front (:mod:`serving.front`) and
  any analysis use; production traffic is split there, by the front, never here;
- the router swaps (production engine, canary engine, canary) under one lock, so a caller never
  gets a canary engine for a canary that has stopped;
- the canary engine is a second weight set: a second in-process ``TorchEngine`` for the torch
  engine; for vLLM the server at ``FLYWHEEL_SERVING_CANARY_URL`` (loaded with the canary
  checkpoint by the follower) or, without one, the managed ``canary`` server
  (:class:`ManagedCanaryServer`), started on the canary checkpoint at ``canary.started`` and
  stopped at ``canary.stopped``; its state file (``$FLYWHEEL_HOME/vllm/canary.json``) is where the
  front finds it;
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
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.checkpoints.store import STABLE, CheckpointStore
from app.core.errors import ConfigurationError, InfrastructureError
from app.core.pids import pid_alive, stop_pid
from app.core.settings import ServingSettings, flywheel_home, get_settings, secret_value
from app.lifecycle.assignment import CANARY, assign_arm
from app.lifecycle.messages import CANARY_CHANGES
from serving.vllm_server import (
    VLLMServer,
    admin_headers,
    record_checkpoint,
    server_healthy,
    set_weight_version,
    start_server,
    stop_server,
    wait_ready,
)

log = logging.getLogger("flywheel.canary")

CANARY_ROLE = "canary"  # the managed server's role (serving.vllm_server.ON_DEMAND_ROLES)


class CanaryServingSettings(BaseSettings):
    """Where a canary is served with the vLLM engine (``FLYWHEEL_SERVING_CANARY_*``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SERVING_CANARY_", extra="ignore")
    url: str | None = None
    """Base URL of a second OpenAI-compatible server the follower loads the canary checkpoint into
    (unset: the watcher starts a managed ``canary`` vLLM server for each canary)."""
    drain_s: float = Field(default=5.0, ge=0)
    """Seconds a managed canary server keeps taking requests after its canary ended (the front moves
    the canary's users within its checkpoint cache time); then it lets the requests in flight
    finish and stops."""


def canary_settings() -> CanaryServingSettings:
    """The ``FLYWHEEL_SERVING_CANARY_*`` settings (environment, then the local stack's env file)."""
    return CanaryServingSettings(_env_file=(flywheel_home() / "stack.env",))


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


_owners: dict[int, "ManagedCanaryServer"] = {}  # canary server pid -> the canary that uses it now
_owners_lock = threading.Lock()


class ManagedCanaryServer:
    """The managed ``canary`` vLLM server serving one canary's checkpoint; :meth:`close` drains and stops it.

    A server of the role that already runs (a watcher restarted during a canary, or the server of
    a canary this one replaces) is kept, and reloaded only if it serves another checkpoint; it then
    belongs to this canary, and the previous one's :meth:`close` leaves it running. Otherwise one
    is started without waiting: it warms up (40-120 s on 2 CPUs) in a thread while the watcher goes
    on, and reports the canary's checkpoint as its weight version once ready; until then the front
    routes everyone to production.

    Args:
        drain_s: seconds the server keeps taking requests after the canary ended, for requests the
            front routes before it moves the canary's users (``FLYWHEEL_SERVING_CANARY_DRAIN_S``);
            then the requests in flight finish and it stops.

    Raises:
        ConfigurationError: vLLM is not installed, or ``path`` is not a model folder.
        InfrastructureError: the running server refused the reload.
    """

    def __init__(
        self,
        checkpoint_id: str,
        path: Path,
        *,
        home: Path | None = None,
        settings: ServingSettings | None = None,
        drain_s: float = 5.0,
    ) -> None:
        from serving.openai_engine import OpenAICompatEngine

        self.checkpoint_id = checkpoint_id
        self.home = home or flywheel_home()
        self.settings = settings or ServingSettings.load()
        self.drain_s = drain_s
        self._closed = threading.Event()
        running = VLLMServer.load(self.home, CANARY_ROLE)
        if running is not None and pid_alive(running.pid) and server_healthy(running.url):
            with _owners_lock:
                _owners[running.pid] = self  # a pending stop of this server is called off
            client = OpenAICompatEngine(
                running.url,
                api_key=secret_value(self.settings.api_key),
                admin_key=secret_value(self.settings.admin_key),
            )
            try:
                if client.checkpoint_id != checkpoint_id:
                    client.load_checkpoint(checkpoint_id, path)
            finally:
                client.close()
            record_checkpoint(CANARY_ROLE, checkpoint_id, path, self.home)
            self.server = VLLMServer.load(self.home, CANARY_ROLE) or running
            return
        if running is not None:
            stop_server(CANARY_ROLE, self.home)
        self.server = start_server(CANARY_ROLE, path, checkpoint_id, self.home, settings=self.settings, wait=False)
        with _owners_lock:
            _owners[self.server.pid] = self
        threading.Thread(target=self._wait_ready, name="canary-server-start", daemon=True).start()

    def _wait_ready(self) -> None:
        try:
            wait_ready(self.server, self.settings.vllm_start_timeout_s, self._admin)
            log.info("canary server %s serves %s", self.server.url, self.checkpoint_id)
        except InfrastructureError as exc:
            if not self._closed.is_set():
                log.error("the canary server for %s failed: production serves every user (%s)", self.checkpoint_id, exc)

    @property
    def url(self) -> str:
        """The server's base URL."""
        return self.server.url

    @property
    def _admin(self) -> dict[str, str]:
        """The canary server's admin key header (the watcher's ``FLYWHEEL_SERVING_ADMIN_KEY``)."""
        return admin_headers(CANARY_ROLE, self.settings)

    def close(self) -> None:
        """Drain and stop the server in a thread (see :meth:`_drain_and_stop`), unless a newer
        canary takes it over meanwhile. Its weight version changes at once, so the front (which
        routes a canary's users only to a server reporting the canary's checkpoint) stops sending
        it users within its cache time."""
        self._closed.set()
        try:
            set_weight_version(self.server.url, f"{self.checkpoint_id}:stopping", self._admin)
        except (InfrastructureError, httpx.HTTPError):
            pass  # not started yet or down: nothing is routed to it either way
        threading.Thread(target=self._drain_and_stop, name="canary-server-stop", daemon=True).start()

    def _owned(self) -> bool:
        with _owners_lock:
            return _owners.get(self.server.pid) is self

    def _drain_and_stop(self) -> None:
        """Wait ``drain_s`` (the front moves the users), then ``POST /pause?mode=wait``, which returns
        once the requests in flight have finished (however slow the host), then stop the server."""
        time.sleep(self.drain_s)
        if not self._owned():
            return  # a newer canary serves from this server now
        try:
            httpx.post(
                self.server.url + "/pause",
                params={"mode": "wait"},
                headers=self._admin,
                timeout=self.settings.vllm_start_timeout_s,
            )
        except httpx.HTTPError:
            pass  # down already: nothing in flight to wait for
        with _owners_lock:
            taken = _owners.get(self.server.pid) is not self
            if not taken:
                _owners.pop(self.server.pid)
        if taken:  # taken over during the pause: serve again
            try:
                httpx.post(self.server.url + "/resume", headers=self._admin, timeout=30)
            except httpx.HTTPError:
                pass
            return
        recorded = VLLMServer.load(self.home, CANARY_ROLE)
        if recorded is not None and recorded.pid == self.server.pid:
            stop_server(CANARY_ROLE, self.home)
        else:
            stop_pid(self.server.pid, timeout_s=20.0)
        log.info("canary server %s (%s) stopped", self.server.url, self.checkpoint_id)


def setup_canary_engine(checkpoint_id: str, path: Path, settings=None, canary: CanaryServingSettings | None = None):
    """A second engine serving ``checkpoint_id`` (see the module invariants for vLLM).

    Raises:
        ConfigurationError: vLLM without ``FLYWHEEL_SERVING_CANARY_URL`` and vLLM not installed here.
        InfrastructureError: the canary server is unreachable or refused the checkpoint.
    """
    settings = settings or get_settings()
    canary = canary or canary_settings()
    if settings.serving.engine == "torch":
        from serving.torch_engine import TorchEngine

        return TorchEngine(path, checkpoint_id=checkpoint_id)
    from serving.openai_engine import OpenAICompatEngine

    if not canary.url:
        return ManagedCanaryServer(checkpoint_id, path, settings=settings.serving, drain_s=canary.drain_s)
    engine = OpenAICompatEngine(
        canary.url, api_key=secret_value(settings.serving.api_key), admin_key=secret_value(settings.serving.admin_key)
    )
    if engine.checkpoint_id != checkpoint_id:
        engine.load_checkpoint(checkpoint_id, path)
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
            self._start(active, folder)
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
            self._start(active, folder)

"""The managed canary vLLM server: started on a canary's checkpoint at ``canary.started``, drained and
stopped after ``canary.stopped``, and where a canary is served (``FLYWHEEL_SERVING_CANARY_*``).

Invariants:

- at most one managed ``canary`` server runs per ``$FLYWHEEL_HOME``; its state file
  (``$FLYWHEEL_HOME/vllm/canary.json``) is where the serving front finds it;
- a server that already runs for the role is kept and reloaded, and belongs to the newest canary:
  an older canary's stop leaves it running;
- a stopped canary's server first reports another weight version (the front, which routes a
  canary's users only to a server reporting the canary's checkpoint, moves them), then drains the
  requests in flight, then stops.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

import httpx
from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.errors import InfrastructureError
from app.core.pids import pid_alive, stop_pid
from app.core.settings import ServingSettings, flywheel_home, secret_value
from serving.openai_engine import OpenAICompatEngine
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

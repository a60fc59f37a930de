"""Long-lived local processes of the loop, started and supervised by ``flywheel up``.

Each is a ``flywheel`` subcommand in its own session (process group), logging to
``$FLYWHEEL_HOME/logs/<name>.log``, and recorded in the stack state so ``flywheel stack down`` (and
``demo --down``) stop exactly what was started, by pid.

Invariant of :class:`Supervisor`: a service that exits is restarted (it logs why), at most
``max_restarts`` times in ``window_s`` seconds; one that keeps dying is given up on, every other
service is stopped and the supervisor exits non-zero, so a loop that cannot turn never looks as if
it does.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from collections.abc import Callable, Collection, Iterable
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from app.core.errors import InfrastructureError
from app.core.pids import pid_alive, stop_pid
from ops.stack import StackState, register_pid

log = logging.getLogger("flywheel.up")

# name -> flywheel arguments, in start order. Beat starts training cycles (FLYWHEEL_TRAIN_INTERVAL,
# FLYWHEEL_TRAIN_READY_TRAJECTORIES) and gate scans; the worker runs them and the release policy.
LOOP_SERVICES: dict[str, list[str]] = {
    "consumer": ["consume"],
    "api": ["api"],
    "relay": ["relay"],
    "watcher": ["watch"],
    "front": ["front"],
    "worker": ["worker"],
    "beat": ["beat"],
}
# Services that call the managed vLLM servers: started once those answer.
SERVING_CLIENTS = ("watcher", "front", "worker", "beat")
SUPERVISOR = "supervisor"
# Services that serve /metrics on FLYWHEEL_METRICS_PORT (the API serves it on its own port; beat has none).
METRICS_SERVICES = ("consumer", "relay", "watcher", "front", "worker")


def metrics_port(name: str, base: int | None) -> int | None:
    """The ``/metrics`` port of loop service ``name`` when ``FLYWHEEL_METRICS_PORT`` is ``base``: one
    host runs every service, so ``base`` starts a block and each service takes ``base`` plus its place
    in :data:`LOOP_SERVICES` (consumer ``base``, relay ``base + 2``, ..., worker ``base + 5``), the same
    after a restart. None: no base, or a service without metrics of its own.

    Raises:
        ValueError: the block would pass port 65535.
    """
    if base is None or name not in METRICS_SERVICES:
        return None
    port = base + list(LOOP_SERVICES).index(name)
    if port > 65535:
        raise ValueError(f"FLYWHEEL_METRICS_PORT={base} leaves no port for {name} ({port} > 65535)")
    return port


def service_env(name: str, env: dict[str, str], services: Collection[str] = LOOP_SERVICES) -> dict[str, str]:
    """``env`` as service ``name`` of ``services`` gets it: ``FLYWHEEL_METRICS_PORT`` replaced by its
    own port (:func:`metrics_port`), or removed for a service without metrics of its own; beat
    beside a ``relay`` process does not also schedule the relay (``FLYWHEEL_OUTBOX_BEAT_RELAY=false``
    unless ``env`` sets it).

    Raises:
        ValueError: ``FLYWHEEL_METRICS_PORT`` is not a port number, or the block passes 65535.
    """
    if name == "beat" and "relay" in services:
        env = {"FLYWHEEL_OUTBOX_BEAT_RELAY": "false", **env}
    raw = env.get("FLYWHEEL_METRICS_PORT")
    if not raw:
        return env
    try:
        base = int(raw)
    except ValueError:
        raise ValueError(f"FLYWHEEL_METRICS_PORT must be a port number, got {raw!r}") from None
    port = metrics_port(name, base)
    out = {k: v for k, v in env.items() if k != "FLYWHEEL_METRICS_PORT"}
    if port is not None:
        out["FLYWHEEL_METRICS_PORT"] = str(port)
    return out


def start_service(name: str, args: list[str], home: Path, env: dict[str, str] | None = None) -> int:
    """Start ``flywheel ARGS`` in the background unless a live process of that name is recorded.

    Returns:
        The pid (new or reused).
    Raises:
        ConfigurationError: no local stack state (run ``flywheel stack up`` first).
    """
    state = StackState.load(home)
    if state and pid_alive(state.extra_pids.get(name)):
        return state.extra_pids[name]
    (home / "logs").mkdir(parents=True, exist_ok=True)
    with open(home / "logs" / f"{name}.log", "ab") as log_file:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", *args],
            env=env or dict(os.environ),
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    register_pid(name, proc.pid, home)
    return proc.pid


def service_status(home: Path) -> dict[str, tuple[int | None, bool]]:
    """name -> (pid, alive) for every recorded service."""
    state = StackState.load(home)
    if state is None:
        return {}
    return {name: (pid, pid_alive(pid)) for name, pid in state.extra_pids.items()}


def wait_http(url: str, timeout_s: float = 60.0) -> None:
    """Wait until ``GET url`` answers 200.

    Raises:
        InfrastructureError: not ready within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise InfrastructureError(f"{url} not ready after {timeout_s:.0f}s")


@dataclass
class Supervisor:
    """Starts the loop's services and keeps them running (see the module invariant).

    Args:
        home: ``$FLYWHEEL_HOME`` (logs, stack state).
        services: name -> flywheel arguments, started in this order.
        env: the environment every service starts with.
        max_restarts: restarts of one service allowed within ``window_s`` seconds.
        window_s: seconds over which restarts are counted.
        poll_s: seconds between liveness checks.
        on_event: called with each line the supervisor logs (``flywheel up`` prints them).

    With ``FLYWHEEL_METRICS_PORT`` in ``env``, each service serves ``/metrics`` on a port of its own
    (:func:`service_env`).
    """

    home: Path
    services: dict[str, list[str]]
    env: dict[str, str]
    max_restarts: int = 3
    window_s: float = 600.0
    poll_s: float = 2.0
    on_event: Callable[[str], None] = log.info
    _restarts: dict[str, deque[float]] = field(default_factory=dict)
    _stop: threading.Event = field(default_factory=threading.Event)

    def start(self, names: Iterable[str] | None = None) -> dict[str, int]:
        """Start (or reuse) the named services (default all). Returns name -> pid."""
        return {
            n: start_service(n, self.services[n], self.home, service_env(n, self.env, self.services))
            for n in (names or self.services)
        }

    def check(self) -> str | None:
        """Restart every dead service; returns the name of one that died too often (None if all run)."""
        now = time.monotonic()
        for name, (pid, alive) in service_status(self.home).items():
            if alive or name not in self.services:
                continue
            recent = self._restarts.setdefault(name, deque())
            while recent and now - recent[0] > self.window_s:
                recent.popleft()
            if len(recent) >= self.max_restarts:
                self.on_event(
                    f"{name} (pid {pid}) died {len(recent) + 1} times in {self.window_s:.0f}s; giving up "
                    f"(see {self.home / 'logs' / (name + '.log')})"
                )
                return name
            recent.append(now)
            self._forget(name)
            new = start_service(name, self.services[name], self.home, service_env(name, self.env, self.services))
            self.on_event(f"{name} (pid {pid}) exited; restarted as pid {new} (restart {len(recent)})")
        return None

    def _forget(self, name: str) -> None:
        state = StackState.load(self.home)
        if state is not None and name in state.extra_pids:
            del state.extra_pids[name]
            state.save(self.home)

    def stop_services(self) -> list[str]:
        """Stop every supervised service (by pid). Returns what was stopped."""
        stopped = []
        for name, (pid, alive) in service_status(self.home).items():
            if name in self.services and alive and pid is not None:
                stop_pid(pid)
                stopped.append(f"{name} (pid {pid})")
            if name in self.services:
                self._forget(name)
        return stopped

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT (exit 0) or a service that keeps dying (exit 1); the
        services are stopped either way. Returns the exit code."""
        if threading.current_thread() is threading.main_thread():  # only there may handlers be set
            for sig in (signal.SIGTERM, signal.SIGINT):
                signal.signal(sig, lambda *_: self._stop.set())
        failed = None
        while not self._stop.wait(self.poll_s):
            failed = self.check()
            if failed is not None:
                break
        stopped = self.stop_services()
        self.on_event("stopped: " + (", ".join(stopped) if stopped else "nothing"))
        return 1 if failed is not None else 0

"""Long-lived local processes started by ``flywheel up`` and ``flywheel demo``.

Each is a ``flywheel`` subcommand in its own session (process group), logging to
``$FLYWHEEL_HOME/logs/<name>.log``, and recorded in the stack state so ``flywheel stack down`` (and
``demo --down``) stop exactly what was started, by pid.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx

from app.core.errors import InfrastructureError
from app.core.pids import pid_alive
from ops.stack import StackState, register_pid

# name -> flywheel arguments. The interval of the training schedule comes from FLYWHEEL_TRAIN_INTERVAL.
LOOP_SERVICES: dict[str, list[str]] = {
    "consumer": ["consume"],
    "worker": ["worker"],
    "beat": ["beat"],
    "api": ["api"],
    "relay": ["relay"],
    "watcher": ["watch"],
}


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
    log = open(home / "logs" / f"{name}.log", "ab")
    proc = subprocess.Popen(
        [sys.executable, "-m", "ops.cli", *args],
        env=env or dict(os.environ),
        stdout=log,
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

"""Processes by pid: whether one is alive, and stopping one this process started."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL a process group leader we started."""
    if not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    for _ in range(20):  # reap it if it is our child, so no zombie outlives the test or CLI
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.05)

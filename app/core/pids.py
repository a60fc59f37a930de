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


def stop_pid(pid: int | None, timeout_s: float = 10.0) -> None:
    """Stop a process group leader we started: SIGTERM to the leader, wait up to ``timeout_s``
    seconds, SIGKILL; then SIGKILL whatever is left of its process group (children that outlived
    it, such as a vLLM server's engine process after the server was killed), also when the leader
    was already dead. Linux allocates no new process a pid still in use as a process group id, so
    the group killed is the one the leader started. No pid (None, 0) stops nothing.

    Raises:
        ValueError: ``pid`` is negative (``os.kill`` would read it as a process group).
    """
    if not pid:
        return
    if pid < 0:
        raise ValueError(f"not a pid: {pid}")
    if pid_alive(pid):
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
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
    _kill_group(pid)


def _kill_group(pgid: int) -> None:
    """SIGKILL the process group ``pgid`` if it still exists (no-op when it does not, is not ours, or
    is this process's own group)."""
    if pgid == os.getpgrp():
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

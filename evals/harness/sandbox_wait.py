"""How a sandboxed run ends: waiting for its process with the wall clock, and killing what is left.

Invariant: nothing of a run outlives it. bwrap's pid namespace dies with its init; a pidfd on
that init (bwrap's ``--info-fd``) says when, and the run's cgroup or, without one, a scan of the
process table for the run's fresh uid is the belt.
"""

from __future__ import annotations

import json
import math
import os
import select
import signal
import subprocess
import time


def live_pids(uid: int) -> list[int]:
    """Pids of ``uid``'s processes that are not zombies (a killed orphan is a zombie until reaped).
    One ``stat`` per process of the host (plain ``os`` calls: pathlib tripled the cost of a scan)."""
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if os.stat(f"/proc/{name}").st_uid != uid:
                continue
            with open(f"/proc/{name}/stat", "rb") as f:
                state = f.read().rsplit(b")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state != b"Z":
            pids.append(int(name))
    return pids


def sandbox_init(info: bytes, uid: int) -> int | None:
    """A pidfd on the sandbox's init (``child-pid`` of bwrap's ``--info-fd`` JSON ``info``), or None
    where it is gone already. The pid is checked to run as ``uid`` after the pidfd is opened (the fresh
    uid runs nothing else on the host), so a pid the kernel gave to another process never counts."""
    try:
        pid = int(json.loads(info)["child-pid"])
        pidfd = os.pidfd_open(pid)
    except (AttributeError, ValueError, KeyError, TypeError, OSError):
        return None
    try:
        with open(f"/proc/{pid}/status", "rb") as f:
            uid_line = next(line for line in f if line.startswith(b"Uid:"))
        if int(uid_line.split()[1]) == uid:
            return pidfd
    except (OSError, StopIteration, ValueError, IndexError):
        pass
    os.close(pidfd)
    return None


def wait_init(init_pidfd: int | None) -> None:
    """Wait (at most 0.2 s) for the sandbox's init (a pidfd, closed here) to exit. The pid namespace
    dies with bwrap: once its init has exited the kernel has killed and released every other process
    in it, but bwrap's outer process exits a moment before that."""
    if init_pidfd is not None:
        try:
            poller = select.poll()
            poller.register(init_pidfd, select.POLLIN)
            poller.poll(200)
        finally:
            os.close(init_pidfd)


def kill_uid(uid: int, init_pidfd: int | None = None) -> None:
    """SIGKILL every process of ``uid`` (runs without a cgroup): first wait for the sandbox's init
    (:func:`wait_init`; without a pidfd, poll the process table for as long); then this is the belt."""
    wait_init(init_pidfd)
    for _ in range(40):
        if not live_pids(uid):
            return
        time.sleep(0.005)
    for _ in range(50):
        subprocess.run(["kill", "-KILL", "-1"], user=uid, group=uid, extra_groups=[], capture_output=True, timeout=10)
        time.sleep(0.05)
        if not live_pids(uid):
            return


def read_available(fd: int, limit: int = 64 * 1024) -> bytes:
    """What the pipe ``fd`` holds now (at most ``limit`` bytes), without waiting for more."""
    os.set_blocking(fd, False)
    data = b""
    try:
        while len(data) < limit and (chunk := os.read(fd, 4096)):
            data += chunk
    except BlockingIOError:
        pass
    return data


def wait_exit(proc: subprocess.Popen, timeout_s: float) -> bool:
    """Wait for ``proc`` to exit, killing its process group at ``timeout_s`` (wall clock, seconds).

    A pidfd wakes this thread the moment the process exits (no helper thread to start, no polling
    sleeps); without ``pidfd_open`` (Linux < 5.3) ``Popen.wait(timeout)`` polls instead.

    Returns:
        Whether the wall clock fired.
    """
    try:
        pidfd = os.pidfd_open(proc.pid)
    except (AttributeError, OSError):
        try:
            proc.wait(timeout_s)
            return False
        except subprocess.TimeoutExpired:
            killpg(proc.pid)
            proc.wait()
            return True
    try:
        poller = select.poll()
        poller.register(pidfd, select.POLLIN)
        fired = not poller.poll(max(1, math.ceil(timeout_s * 1000)))  # EINTR: retried with the time left
    finally:
        os.close(pidfd)
    if fired:
        killpg(proc.pid)
    proc.wait()
    return fired


def killpg(pid: int) -> None:
    try:
        os.killpg(pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass

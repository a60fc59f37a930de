"""``stop_pid``: a stopped process group leaves no process behind, also when its leader died first."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from app.core.pids import pid_alive, stop_pid

# The leader starts a child that ignores SIGTERM (as a busy engine process may), prints its pid, and sleeps.
LEADER = """
import signal, subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); print('ready', flush=True); time.sleep(300)"], stdout=subprocess.PIPE, text=True)
child.stdout.readline()
print(child.pid, flush=True)
time.sleep(300)
"""


def _group() -> tuple[subprocess.Popen, int]:
    leader = subprocess.Popen([sys.executable, "-c", LEADER], stdout=subprocess.PIPE, text=True, start_new_session=True)
    child = int(leader.stdout.readline())
    assert pid_alive(child) and os.getpgid(child) == leader.pid
    return leader, child


def _gone(pid: int, timeout_s: float = 5.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(pid):
            return True
        time.sleep(0.05)
    return False


def test_stopping_a_leader_stops_the_child_that_ignored_sigterm():
    leader, child = _group()
    stop_pid(leader.pid, timeout_s=5.0)
    assert not pid_alive(leader.pid)
    assert _gone(child), "the leader's child outlived stop_pid"


def test_a_group_whose_leader_already_died_is_cleared():
    """The leader was killed (a crashed server); its child lives on in the group; stopping the dead
    leader's pid still ends it."""
    leader, child = _group()
    os.kill(leader.pid, signal.SIGKILL)
    leader.wait(5)
    assert pid_alive(child)
    stop_pid(leader.pid)
    assert _gone(child), "the orphaned child of a dead leader outlived stop_pid"


def test_a_pid_that_leads_no_group_touches_no_other_process():
    """A process started without its own session shares ours; stopping it must not signal our group."""
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    stop_pid(proc.pid, timeout_s=5.0)
    assert not pid_alive(proc.pid) and pid_alive(os.getpid())


def test_no_pid_stops_nothing():
    """A state file's missing pid (None, 0) must not become ``killpg(0)``, our own process group; a
    negative one (a group, to ``os.kill``) is refused."""
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])  # in our group
    try:
        stop_pid(None)
        stop_pid(0)
        assert pid_alive(child.pid) and pid_alive(os.getpid())
        with pytest.raises(ValueError):
            stop_pid(-child.pid)
        assert pid_alive(child.pid)
    finally:
        child.kill()
        child.wait()

"""The supervisor of ``flywheel up``: a loop process killed with SIGKILL comes back, one that keeps
dying stops the loop with exit code 1, and what it started is stopped by pid.

Real processes (``flywheel relay`` on the test database and broker; a command that fails at once),
a real stack state file; nothing is mocked.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from app.core.pids import pid_alive
from ops.processes import Supervisor, service_status
from ops.stack import StackState

pytestmark = pytest.mark.integration


@pytest.fixture
def up_home(tmp_path, db, kafka_bootstrap) -> tuple[Path, dict[str, str]]:
    """A home whose stack state names the test database and broker (what ``stack up`` writes)."""
    home = tmp_path / "home"
    StackState(database_url=db, kafka_bootstrap=kafka_bootstrap).save(home)
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(FLYWHEEL_HOME=str(home), FLYWHEEL_TELEMETRY_EXPORTER="none")
    return home, env


def _wait(predicate, timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.2)
    raise AssertionError(f"not within {timeout_s}s: {what}")


def test_a_killed_process_is_restarted_and_stopped_by_pid_at_the_end(up_home):
    home, env = up_home
    events: list[str] = []
    sup = Supervisor(home, {"relay": ["relay"]}, env, poll_s=0.2, on_event=events.append)
    first = sup.start()["relay"]
    assert pid_alive(first)
    os.kill(first, signal.SIGKILL)
    _wait(lambda: not pid_alive(first), 10, "the killed relay is gone")
    assert sup.check() is None
    second = service_status(home)["relay"][0]
    assert second != first and pid_alive(second)
    assert any("restarted" in e and str(first) in e for e in events), events

    stopped = sup.stop_services()
    assert stopped == [f"relay (pid {second})"]
    _wait(lambda: not pid_alive(second), 15, "the relay is stopped")
    assert "relay" not in StackState.load(home).extra_pids


def test_a_process_that_keeps_dying_stops_the_loop_with_exit_code_1(up_home):
    home, env = up_home
    events: list[str] = []
    services = {"relay": ["relay"], "broken": ["no-such-command"]}  # typer exits 2 at once
    sup = Supervisor(home, services, env, poll_s=0.3, max_restarts=2, window_s=60, on_event=events.append)
    sup.start()
    relay = service_status(home)["relay"][0]
    assert sup.run() == 1  # returns once "broken" died a third time in the window; stops the rest
    assert sum("restarted" in e for e in events) == 2, events
    assert any("broken" in e and "giving up" in e for e in events), events
    assert any(f"relay (pid {relay})" in e for e in events if e.startswith("stopped:")), events
    _wait(lambda: not pid_alive(relay), 15, "the healthy relay is stopped with the loop")
    assert service_status(home) == {}

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


def test_each_supervised_service_serves_metrics_on_a_port_of_its_own(up_home):
    """``FLYWHEEL_METRICS_PORT`` under the supervisor starts a block: the consumer and the relay
    (real processes on the test database and broker) answer ``/metrics`` on their own ports at once,
    where a shared port would leave all but the first without metrics; beat gets none."""
    import httpx

    from app.core.net import free_port
    from ops.processes import service_env
    from ops.up import write_prometheus_targets

    home, env = up_home
    base = free_port()
    env = {**env, "FLYWHEEL_METRICS_PORT": str(base)}
    assert "FLYWHEEL_METRICS_PORT" not in service_env("beat", env)
    # beat beside the relay process leaves the relay to it; alone (or told otherwise) it relays too
    assert service_env("beat", env)["FLYWHEEL_OUTBOX_BEAT_RELAY"] == "false"
    assert "FLYWHEEL_OUTBOX_BEAT_RELAY" not in service_env("beat", env, services=["worker", "beat"])
    assert service_env("beat", {**env, "FLYWHEEL_OUTBOX_BEAT_RELAY": "true"})["FLYWHEEL_OUTBOX_BEAT_RELAY"] == "true"
    with pytest.raises(ValueError, match="port number"):
        service_env("relay", {**env, "FLYWHEEL_METRICS_PORT": "x"})
    sup = Supervisor(home, {"consumer": ["consume"], "relay": ["relay"]}, env, poll_s=0.2)
    sup.start()
    ports = {"consumer": base, "relay": base + 2}
    try:

        def serving(port: int) -> bool:
            try:
                return httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        _wait(lambda: all(serving(p) for p in ports.values()), 60, "both services' /metrics")
        for name, port in ports.items():  # each process says which port it took
            assert f"metrics on http://127.0.0.1:{port}/metrics" in (home / "logs" / f"{name}.log").read_text()
        assert not serving(base + 1)  # the API's place in the block: the API serves /metrics on its own port
        targets = write_prometheus_targets(home, ports)
        assert f"127.0.0.1:{base + 2}" in targets.read_text()
    finally:
        sup.stop_services()

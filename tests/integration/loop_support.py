"""The deployed loop's services under a supervisor, as the fault tests run them: a stack of the
test's own, ``ops.processes.Supervisor`` in a thread, and the kill-and-restart helpers
(``test_loop_faults.py``, ``test_serving_faults.py``)."""

from __future__ import annotations

import os
import signal
import threading
from dataclasses import dataclass, field
from pathlib import Path

from app.core.net import free_port
from app.core.pids import pid_alive
from consumers.testing import wait_for
from ops.processes import Supervisor, service_status
from ops.stack import StackState


@dataclass
class Loop:
    """A stack of the test's own and the loop's services under a supervisor running in a thread.

    ``events`` collects the supervisor's lines ("... exited; restarted as ...", "giving up").
    """

    home: Path
    env: dict[str, str]
    services: dict[str, list[str]]
    events: list[str] = field(default_factory=list)
    supervisor: Supervisor | None = None
    thread: threading.Thread | None = None
    exit_code: list[int] = field(default_factory=list)

    @property
    def state(self) -> StackState:
        state = StackState.load(self.home)
        assert state is not None
        return state

    @property
    def url(self) -> str:
        return self.state.database_url

    @property
    def bootstrap(self) -> str:
        return self.state.kafka_bootstrap

    def start(self) -> None:
        self.supervisor = Supervisor(self.home, self.services, self.env, poll_s=1.0, on_event=self.events.append)
        self.supervisor.start()
        self.thread = threading.Thread(target=lambda: self.exit_code.append(self.supervisor.run()), daemon=True)
        self.thread.start()

    def pid(self, name: str) -> int:
        pid, alive = service_status(self.home)[name]
        assert alive, f"{name} is not running; {self.log(name)[-2000:]}"
        return pid

    def log(self, name: str) -> str:
        path = self.home / "logs" / f"{name}.log"
        return path.read_text(errors="replace") if path.exists() else ""

    def restarts(self, name: str) -> int:
        return sum(e.startswith(f"{name} (pid") and "restarted" in e for e in self.events)

    def all_running(self) -> bool:
        status = service_status(self.home)
        return all(status.get(n, (None, False))[1] for n in self.services)

    def stop(self) -> None:
        if self.supervisor is not None:
            self.supervisor._stop.set()
            if self.thread is not None:
                self.thread.join(60)


def _service_env(home: Path) -> dict[str, str]:
    """What ``flywheel up`` hands its services: its own environment, the stack's settings being in
    ``$FLYWHEEL_HOME/stack.env`` (read by each service at start)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_HOME=str(home),
        FLYWHEEL_TELEMETRY_EXPORTER="none",
        FLYWHEEL_API_PORT=str(free_port()),
        FLYWHEEL_OUTBOX_INTERVAL="1",
        FLYWHEEL_CONSUMER_RETRY_MAX_WAIT_S="2",
    )
    return env


def _kill(pid: int) -> None:
    """``kill -9``: no handler runs, nothing is flushed or committed."""
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), 10, what=f"pid {pid} gone")


def _restarted(loop: Loop, name: str, old_pid: int, timeout_s: float = 60.0) -> int:
    """The pid the supervisor restarted ``name`` as, once it runs."""

    def new_pid() -> int | None:
        pid, alive = service_status(loop.home).get(name, (None, False))
        return pid if alive and pid != old_pid else None

    return wait_for(new_pid, timeout_s, interval_s=0.1, what=f"{name} restarted")

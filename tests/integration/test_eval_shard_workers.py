"""A sharded eval run on two real Celery workers (``celery worker --concurrency 1`` subprocesses)
with a tiny random model on the reference engine, through the real harness and sandbox: both workers
take shards, the stored results and the summary equal the unsharded run's, and a worker killed
mid-shard (SIGKILL, no goodbye) has its shard retried so the run completes.

Runs on kombu's SQL transport (the embedded stack's broker, which never redelivers a message a killed
worker took) and on the local Redis when the ``redis`` client is installed and the server answers.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import pytest
from kombu import Exchange, Queue
from sqlalchemy import select

from app.checkpoints.publish import publish_folder
from app.core.db import session_scope
from app.core.settings import get_settings
from app.models import EvalResult, EvalShard
from app.repositories.checkpoints import add_checkpoint
from app.worker.celery_app import create_celery_app
from evals import runner, shards, store
from evals.config import load_suite
from evals.tasks import load_tasks

try:
    import redis
except ImportError:  # the optional `redis` extra: the Redis case is skipped without it
    redis = None

pytestmark = pytest.mark.integration

REDIS_URL = "redis://127.0.0.1:6379/0"
COMPARED = (
    "task_id",
    "sample_index",
    "passed",
    "attempts",
    "turns",
    "completion_tokens",
    "tool_calls",
    "tool_call_errors",
    "asked_question",
    "edited",
)


def _redis_up() -> bool:
    if redis is None:
        return False
    try:
        return bool(redis.Redis.from_url(REDIS_URL, socket_connect_timeout=1).ping())
    except redis.RedisError:
        return False


@pytest.fixture(params=["sql", pytest.param("redis", marks=pytest.mark.skipif(not _redis_up(), reason="no Redis"))])
def broker_env(request, monkeypatch) -> dict[str, str]:
    """The broker settings for this run: kombu's SQL transport on the test database, or Redis."""
    env = {"FLYWHEEL_REDIS_URL": REDIS_URL} if request.param == "redis" else {}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    get_settings.cache_clear()
    return env


@pytest.fixture
def tiny_checkpoint(db, tiny_model_dir, monkeypatch) -> str:
    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "reference")
    path = publish_folder(tiny_model_dir, "tiny", {"id": "tiny"})
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="tiny", path=str(path))
    return "tiny"


class Worker:
    """``celery -A app.worker.celery_app worker --concurrency 1`` on one queue, in its own session."""

    def __init__(self, name: str, queue: str, env: dict[str, str], log: Path):
        self.name, self.log = name, log
        self._out = open(log, "wb")
        self.proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "celery",
                "-A",
                "app.worker.celery_app",
                "worker",
                "--concurrency",
                "1",
                "--queues",
                queue,
                "--hostname",
                f"{name}@%h",
                "--loglevel",
                "INFO",
                "--without-gossip",
                "--without-mingle",
                "--without-heartbeat",
            ],
            env=env,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )

    def wait_ready(self, timeout_s: float = 90.0) -> None:
        deadline = time.monotonic() + timeout_s
        while b" ready." not in self.log.read_bytes():
            assert self.proc.poll() is None, self.log.read_text()[-3000:]
            assert time.monotonic() < deadline, f"{self.name} not ready:\n{self.log.read_text()[-3000:]}"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the worker and its pool child at once (a lost machine, not a shutdown)."""
        os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait()

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        self._out.close()


def create_broker_tables(app, queues: tuple[str, ...] = ()) -> None:
    """On the SQL transport, create kombu's and Celery's result tables, and the rows of ``queues``,
    before two workers race to (both run ``CREATE TABLE``, and both insert a new queue's row, on
    first use; the loser exits)."""
    if not app.conf.broker_url.startswith("sqla+"):
        return
    with app.connection_for_write() as conn:
        conn.default_channel.session  # noqa: B018  (kombu creates its tables on first use)
        for name in queues:
            Queue(name, Exchange(name), routing_key=name).bind(conn.default_channel).declare()
    app.backend.ResultSession().close()


def results(run_id: str) -> list[tuple]:
    with session_scope() as s:
        found = s.scalars(select(EvalResult).where(EvalResult.run_id == uuid.UUID(run_id))).all()
        return sorted(tuple(getattr(r, f) for f in COMPARED) for r in found)


def suite_and_tasks():
    """12 generated function requests, every other one already solved in its repository (so the
    pass rate is neither 0 nor 1 whatever the tiny random model writes); short budgets. Each grading
    sleeps 1 s first, so a shard (3 tasks) stays part-stored for seconds: the test's 50 ms poll sees
    it mid-shard on any machine (without the sleep a fast one finished shards between two polls)."""
    tasks = load_tasks("functions", "test", limit=12, seed=0)
    tasks = [
        t.model_copy(
            update={
                "files": {**t.files, **t.reference_files} if i % 2 else t.files,
                "test_command": f"sleep 1 && {t.test_command}",
            }
        )
        for i, t in enumerate(tasks)
    ]
    return load_suite("functions").with_overrides(max_turns=2, max_tokens_per_turn=24), tasks


def test_two_workers_share_the_shards_and_a_killed_workers_shard_is_retried(
    broker_env, tiny_checkpoint, db, flywheel_home, tmp_path
):
    queue = f"evals-test-{uuid.uuid4().hex[:8]}"  # no other worker on this broker takes our shards
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLYWHEEL_")}
    env.update(
        FLYWHEEL_DATABASE_URL=db,
        FLYWHEEL_HOME=str(flywheel_home),  # the checkpoint store the tiny model was published to
        FLYWHEEL_TELEMETRY_EXPORTER="none",
        FLYWHEEL_SERVING_ENGINE="reference",
        FLYWHEEL_EVAL_SHARD_HEARTBEAT_S="0.5",
        **broker_env,
    )
    app = create_celery_app()
    create_broker_tables(app, (queue,))
    workers = [Worker(name, queue, env, tmp_path / f"{name}.log") for name in ("w1", "w2")]
    try:
        suite, tasks = suite_and_tasks()
        plain = runner.run_suite(tiny_checkpoint, suite, tasks=tasks, workers=1)  # today's path, meanwhile
        assert plain.status == "succeeded" and 0 < plain.passed < plain.planned
        for w in workers:
            w.wait_ready()

        execute = shards.ShardedExecution(
            shards=4,
            dispatch=lambda run_id, index: app.send_task("flywheel.evals.run_shard", args=[run_id, index], queue=queue),
            timeout_s=4.0,
            heartbeat_s=0.5,
            poll_s=0.2,
        )
        outcome: dict = {}

        def coordinate():
            outcome["summary"] = runner.run_suite(
                tiny_checkpoint, suite, tasks=tasks, workers=1, force=True, execute=execute
            )

        coordinator = threading.Thread(target=coordinate)
        coordinator.start()

        # Kill the first worker seen with part of a shard stored (mid-shard), whichever of the two
        # the broker gave it to (one may take every shard before the other starts); note what it
        # had stored.
        by_name, victim, killed = {w.name: w for w in workers}, None, None
        deadline = time.monotonic() + 90
        while killed is None and coordinator.is_alive():
            assert time.monotonic() < deadline, "\n".join(w.log.read_text()[-1500:] for w in workers)
            with session_scope() as s:
                for shard in s.scalars(select(EvalShard).where(EvalShard.status == "running")):
                    victim = by_name.get((shard.worker or "").split("@")[0])
                    if victim is None:
                        continue
                    ids = [t["id"] for t in shard.tasks]
                    stored = s.scalars(
                        select(EvalResult.id).where(EvalResult.run_id == shard.run_id, EvalResult.task_id.in_(ids))
                    ).all()
                    if 0 < len(stored) < len(ids):
                        victim.kill()
                        killed = (shard.run_id, shard.shard_index, sorted(stored))
                        break
            time.sleep(0.05)
        coordinator.join(timeout=120)
        assert not coordinator.is_alive(), "the sharded run did not finish"
        assert killed is not None, "no worker was seen mid-shard"

        sharded = outcome["summary"]
        assert sharded.status == "succeeded" and sharded.run_id != plain.run_id
        assert results(sharded.run_id) == results(plain.run_id)
        for key in ("planned", "done", "passed", "pass_rate", "low", "high", "pass_at_k", "best_of_k"):
            assert getattr(sharded, key) == getattr(plain, key), key

        run_id, index, stored_before = killed
        with session_scope() as s:
            rows = store.shards(s, run_id)
            lost = rows[index]
            assert lost.status == "done" and lost.attempts >= 2 and not lost.worker.startswith(f"{victim.name}@")
            assert any(f"lost: {victim.name}@" in e for e in lost.errors)
            # what the killed worker stored before it died was kept, not run again
            ids = [t["id"] for t in lost.tasks]
            kept = s.scalars(
                select(EvalResult.id).where(EvalResult.run_id == run_id, EvalResult.task_id.in_(ids))
            ).all()
            assert set(stored_before) <= set(kept) and len(kept) == len(ids)
        # every shard finished; the killed worker's claim was taken over by another (the surviving
        # worker, or the gating process itself)
        assert all(r.status == "done" for r in rows), [(r.worker, r.status) for r in rows]
    finally:
        for w in workers:
            w.stop()

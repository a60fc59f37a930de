"""Sharded eval runs on real Postgres, in one process: the coordinator, workers on threads, and
claims whose worker died (a claim that never heartbeats). Sessions are a deterministic stub (the
harness is covered by ``test_eval_harness.py``; real Celery workers by ``test_eval_shard_workers.py``)."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from sqlalchemy import select

from app.core.db import session_scope
from app.models import EvalResult, EvalRun, EvalShard
from app.repositories.checkpoints import add_checkpoint
from app.worker.celery_app import create_celery_app
from evals import automation, runner, shards, store
from evals.config import SuiteConfig
from evals.tasks.model import Task
from tests.integration.test_eval_gating import CONFIG, Engine, Policies, checkpoints  # noqa: F401
from tests.integration.test_eval_gating import TASKS as GATE_TASKS

pytestmark = pytest.mark.integration

SUITE = SuiteConfig(name="stub", version="1", source="functions", samples_per_task=2)
# two files out of key order: a stored shard must keep each task exactly as planned (its hash)
TASKS = [
    Task(id=f"t{i}", source="stub", split="test", request="do it", files={"z.py": "", "a.py": ""}, test_command="true")
    for i in range(7)
]
COMPARED = ("task_id", "sample_index", "passed", "attempts", "turns", "completion_tokens", "tool_calls", "edited")


class Sessions:
    """Stands in for ``run_sample``: the outcome depends only on (task, sample); records who ran what."""

    def __init__(self, delay_s: float = 0.0):
        self.calls: list[tuple[str, int, str]] = []
        self.delay_s = delay_s
        self.lock = threading.Lock()

    def __call__(self, engine, suite, task, sample_index, work_root, run_id):
        with self.lock:
            self.calls.append((task.id, sample_index, threading.current_thread().name))
        time.sleep(self.delay_s)
        n = int(task.id[1:])
        return {
            "passed": (n + sample_index) % 3 != 0,
            "attempts": 1,
            "turns": 1 + n % 2,
            "completion_tokens": 10 * n + sample_index,
            "latency_s": 0.01,
            "tool_calls": n % 3,
            "tool_call_errors": 0,
            "asked_question": False,
            "edited": bool(n % 2),
            "detail": {},
        }


class StubEngine:
    checkpoint_id = "c1"

    def close(self):
        pass


@pytest.fixture
def ckpt(db, monkeypatch):
    monkeypatch.setattr(runner, "eval_engine", lambda checkpoint_id: StubEngine())
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="c1", path="/nonexistent/c1")
    return "c1"


def rows(run_id: str) -> list[tuple]:
    with session_scope() as s:
        found = s.scalars(select(EvalResult).where(EvalResult.run_id == run_id)).all()
        return sorted(tuple(getattr(r, f) for f in COMPARED) for r in found)


def shard_rows(run_id: str) -> list[EvalShard]:
    with session_scope() as s:
        return store.shards(s, run_id)


def ghost_claim(run_id: str, index: int) -> int:
    """Claim a shard as a worker that dies at once (never heartbeats); the claim's attempt."""
    with session_scope() as s:
        return store.claim_shard(s, run_id, "ghost@dead", index=index).attempts


def test_layout_is_contiguous_balanced_and_never_empty():
    assert [[t.id for t in s] for s in shards.layout(TASKS, 3)] == [["t0", "t1", "t2"], ["t3", "t4"], ["t5", "t6"]]
    assert len(shards.layout(TASKS, 50)) == 7 and all(len(s) == 1 for s in shards.layout(TASKS, 50))
    assert [len(s) for s in shards.layout(TASKS, 1)] == [7]
    with pytest.raises(ValueError):
        shards.layout(TASKS, 0)


def test_shard_messages_go_to_the_evals_queue_and_a_plain_worker_consumes_both(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", "postgresql://u@db.example:5432/fw")
    app = create_celery_app()
    route = app.amqp.router.route
    assert route({}, "flywheel.evals.run_shard")["queue"].name == "evals"
    assert route({}, "flywheel.evals.evaluate_candidate")["queue"].name == "celery"  # gating stays serial
    assert route({}, "flywheel.trainer.run_cycle")["queue"].name == "celery"
    assert set(app.amqp.queues.consume_from) == {"celery", "evals"}


def test_shards_on_workers_store_what_the_unsharded_run_stores(ckpt, monkeypatch):
    # A shard (2-3 tasks x 2 samples, one at a time) runs 4-6 s, past the 3.5 s timeout: only heartbeats
    # keep it. The margin (35 beats) holds on a loaded 2-core CI machine, where 2 s stalls were seen.
    sessions = Sessions(delay_s=1.0)
    monkeypatch.setattr(runner, "run_sample", sessions)
    plain = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=StubEngine(), workers=1)

    pool = ThreadPoolExecutor(2, thread_name_prefix="worker")
    dispatched: list[int] = []

    def dispatch(run_id, index):
        dispatched.append(index)
        pool.submit(shards.take_shard, run_id, index, worker=f"w{index}", workers=1, heartbeat_s=0.1)

    sharded = runner.run_suite(
        ckpt,
        SUITE,
        tasks=TASKS,
        engine=StubEngine(),
        workers=1,
        force=True,
        execute=shards.ShardedExecution(shards=3, dispatch=dispatch, timeout_s=3.5, heartbeat_s=0.1, poll_s=0.05),
    )
    pool.shutdown(wait=True)
    assert sharded.run_id != plain.run_id and sharded.status == "succeeded"
    assert rows(sharded.run_id) == rows(plain.run_id)
    for key in ("planned", "done", "passed", "pass_rate", "low", "high", "pass_at_k", "best_of_k"):
        assert getattr(sharded, key) == getattr(plain, key), key
    assert {k: v for k, v in sharded.monitors.items() if "latency" not in k} == {
        k: v for k, v in plain.monitors.items() if "latency" not in k
    }
    assert sorted(dispatched) == [0, 1, 2]
    # sessions here wait (as on a vLLM server): three executors take about a third of the time
    assert sharded.elapsed_s < 0.6 * plain.elapsed_s, (sharded.elapsed_s, plain.elapsed_s)
    done = shard_rows(sharded.run_id)
    assert [s.status for s in done] == ["done"] * 3 and all(s.attempts == 1 for s in done), "none presumed lost"
    # the worker threads took the first shards, the coordinator the last (highest index first)
    assert [s.worker for s in done] == ["w0", "w1", shards.worker_name()]

    # A shard message delivered again (a redelivery) finds the shard done and writes nothing.
    again = shards.take_shard(sharded.run_id, 1, worker="late", workers=1, heartbeat_s=0.1)
    assert again == {"run_id": sharded.run_id, "shard": 1, "skipped": "done"}
    assert rows(sharded.run_id) == rows(plain.run_id)


def test_a_lost_workers_shard_is_retried_and_the_lost_claim_is_fenced_out(ckpt, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Sessions())
    calls: list[int] = []
    lost: dict[int, int] = {}

    def dispatch(run_id, index):
        calls.append(index)
        if index == 0 and not lost:
            lost[0] = ghost_claim(run_id, 0)

    summary = runner.run_suite(
        ckpt,
        SUITE,
        tasks=TASKS,
        engine=StubEngine(),
        workers=1,
        execute=shards.ShardedExecution(shards=3, dispatch=dispatch, timeout_s=2.0, heartbeat_s=0.1, poll_s=0.05),
    )
    assert summary.status == "succeeded" and summary.done == summary.planned == 14
    first = shard_rows(summary.run_id)[0]
    assert first.status == "done" and first.attempts == 2 and first.worker == shards.worker_name()
    assert len(first.errors) == 1 and "attempt 1 lost: ghost@dead" in first.errors[0]
    assert calls.count(0) == 2, "the lost shard was dispatched again"
    with session_scope() as s:  # the dead claimant can no longer beat or close the shard
        assert not store.heartbeat_shard(s, first.run_id, 0, lost[0])
        assert not store.finish_shard(s, first.run_id, 0, lost[0], [])


def test_a_shard_lost_every_time_fails_the_run_and_a_rerun_retries_it(ckpt, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Sessions())

    def always_lost(run_id, index):
        if index == 2:
            ghost_claim(run_id, 2)

    execute = shards.ShardedExecution(
        shards=3, dispatch=always_lost, timeout_s=0.3, max_attempts=2, heartbeat_s=0.1, poll_s=0.05
    )
    failed = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=StubEngine(), workers=1, execute=execute)
    assert failed.status == "failed" and failed.done == 10  # shard 2 holds t5, t6 (4 samples)
    assert any("failed after 2 lost attempts" in e for e in failed.errors)
    assert [s.status for s in shard_rows(failed.run_id)] == ["done", "done", "failed"]

    rerun = runner.run_suite(
        ckpt,
        SUITE,
        tasks=TASKS,
        engine=StubEngine(),
        workers=1,
        execute=shards.ShardedExecution(shards=5, dispatch=lambda r, i: None, heartbeat_s=0.1, poll_s=0.05),
    )
    assert rerun.run_id == failed.run_id and rerun.status == "succeeded"
    assert (rerun.reused, rerun.ran, rerun.done) == (10, 4, 14)
    assert len(shard_rows(rerun.run_id)) == 3, "a resumed run keeps its layout"


def test_an_automated_gate_with_shards_runs_every_sample_once_and_decides(checkpoints, monkeypatch):  # noqa: F811
    policies = Policies()
    monkeypatch.setattr(runner, "run_sample", policies)

    class WorkerEngine(Engine):  # what a shard worker builds for the run's checkpoint (and closes)
        def close(self):
            pass

    monkeypatch.setattr(runner, "eval_engine", WorkerEngine)
    monkeypatch.setenv("FLYWHEEL_EVAL_SHARDS", "3")
    sent: list[tuple[str, int]] = []

    def deliver(run_id, index):  # a worker takes shard 0 at once; the gating process takes the rest
        sent.append((run_id, index))
        if index == 0:
            automation.run_shard.apply(args=[run_id, index]).get()

    monkeypatch.setattr(automation.run_shard, "delay", deliver)
    result = automation.evaluate(
        "good",
        config=CONFIG,
        suites=sorted(GATE_TASKS),
        tasks=GATE_TASKS,
        engine_factory=Engine,
        overrides={"samples_per_task": 1},
    )
    assert result["passed"] is True
    assert policies.calls == {"base": 60, "good": 60}, "every sample ran once, across shards"
    with session_scope() as s:
        runs = s.scalars(select(EvalRun)).all()
        assert len(runs) == 4 and all(r.status == "succeeded" and r.summary["done"] == 30 for r in runs)
        for run in runs:
            rows_ = store.shards(s, run.id)
            assert [len(r.tasks) for r in rows_] == [10, 10, 10] and {r.status for r in rows_} == {"done"}
            assert rows_[0].worker != shards.worker_name() and rows_[2].worker == shards.worker_name()
    assert sorted(i for _, i in sent) == sorted([0, 1, 2] * 4)

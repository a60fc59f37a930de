"""Runner bookkeeping on real Postgres: resume after an interruption, cached runs, errors, locking.

The agent session itself is replaced by a counting stub here (the harness path is covered by
``test_eval_harness.py``), so these tests pin down exactly which samples run on each attempt.
"""

from __future__ import annotations

import threading
import uuid

import pytest
from pydantic import BaseModel, Field
from sqlalchemy import select

from app.core.db import session_scope
from app.core.errors import ConflictError
from app.models import EvalRun
from app.repositories.checkpoints import add_checkpoint
from evals import runner, store
from evals.config import SuiteConfig
from evals.plan import plan_run

pytestmark = pytest.mark.integration


class StubTask(BaseModel):
    """The fields of ``evals.tasks.model.Task`` the runner's bookkeeping reads."""

    id: str
    source: str = "stub"
    split: str = "test"
    request: str = "do it"
    files: dict[str, str] = Field(default_factory=dict)
    test_command: str = "true"
    test_files: dict[str, str] = Field(default_factory=dict)
    reference_files: dict[str, str] = Field(default_factory=dict)
    metadata: dict = Field(default_factory=dict)


class Interrupted(Exception):
    pass


class Sessions:
    """Stands in for ``run_sample``: records calls; task ``t3`` passes, ``fail`` ids raise."""

    def __init__(self, failing: set[str] = frozenset()):
        self.calls: list[tuple[str, int]] = []
        self.failing = set(failing)
        self.lock = threading.Lock()

    def __call__(self, engine, suite, task, sample_index, work_root, run_id):
        with self.lock:
            self.calls.append((task.id, sample_index))
        if task.id in self.failing:
            raise RuntimeError("sandbox unavailable")
        return {
            "passed": task.id.endswith(("0", "2", "4")),
            "attempts": 1,
            "turns": 2,
            "completion_tokens": 50,
            "latency_s": 0.1,
            "tool_calls": 3,
            "tool_call_errors": 0,
            "asked_question": False,
            "edited": True,
            "detail": {},
        }


SUITE = SuiteConfig(name="stub", version="1", source="humaneval", samples_per_task=2)
TASKS = [StubTask(id=f"t{i}") for i in range(5)]


@pytest.fixture
def ckpt(db):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="c1", path="/nonexistent/c1")
    return "c1"


def test_interrupted_run_resumes_and_skips_done_samples(ckpt, monkeypatch):
    first = Sessions()
    monkeypatch.setattr(runner, "run_sample", first)
    stored: list = []

    def stop_after_four(task_id, sample, fields):
        stored.append((task_id, sample))
        if len(stored) == 4:
            raise Interrupted  # the process dies here: results so far are committed

    with pytest.raises(Interrupted):
        runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object(), on_result=stop_after_four)
    with session_scope() as s:
        (run,) = s.scalars(select(EvalRun)).all()
        assert run.status == "running"
        assert store.done_keys(s, run.id) == set(stored)

    second = Sessions()
    monkeypatch.setattr(runner, "run_sample", second)
    summary = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    assert summary.status == "succeeded" and summary.run_id == str(run.id)
    assert (summary.reused, summary.ran, summary.done, summary.planned) == (4, 6, 10, 10)
    assert set(second.calls).isdisjoint(stored) and len(second.calls) == 6
    assert summary.passed == 6 and summary.pass_rate == pytest.approx(0.6)
    assert summary.low < 0.6 < summary.high

    third = Sessions()
    monkeypatch.setattr(runner, "run_sample", third)
    cached = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    assert cached.cached and cached.run_id == summary.run_id and third.calls == []


def test_a_changed_plan_is_a_new_run(ckpt, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Sessions())
    a = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    b = runner.run_suite(ckpt, SUITE, tasks=TASKS[:3], engine=object())
    c = runner.run_suite(ckpt, SUITE.model_copy(update={"samples_per_task": 1}), tasks=TASKS, engine=object())
    assert len({a.suite_version, b.suite_version, c.suite_version}) == 3
    assert not b.cached and not c.cached and b.planned == 6 and c.planned == 5


def test_session_errors_are_not_stored_and_rerun_retries_only_them(ckpt, monkeypatch):
    flaky = Sessions(failing={"t1"})
    monkeypatch.setattr(runner, "run_sample", flaky)
    summary = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object(), workers=2)
    assert summary.status == "failed" and summary.done == 8
    assert len(summary.errors) == 2 and "sandbox unavailable" in summary.errors[0]
    with session_scope() as s:
        outs = store.outcomes(s, s.get(EvalRun, uuid.UUID(summary.run_id)))
        assert len(outs.planned) == 10 and {o.task_id for o in outs.outcomes} == {"t0", "t2", "t3", "t4"}

    healed = Sessions()
    monkeypatch.setattr(runner, "run_sample", healed)
    again = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    assert again.status == "succeeded" and again.run_id == summary.run_id
    assert sorted(healed.calls) == [("t1", 0), ("t1", 1)]


def test_the_same_run_cannot_execute_twice_at_once(ckpt, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Sessions())
    plan = plan_run(SUITE, TASKS)
    with store.advisory_lock("eval", ckpt, SUITE.name, plan.suite_version):
        with pytest.raises(ConflictError, match="already running"):
            runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    assert runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object()).status == "succeeded"


KILLED_RUN = """
import sys, time
from evals import runner
from evals.config import SuiteConfig
from tests.integration.test_eval_runner_resume import SUITE, TASKS, Sessions

inner = Sessions()
def slow(*args):
    time.sleep(0.3)
    return inner(*args)
runner.run_sample = slow
runner.run_suite("c1", SUITE, tasks=TASKS, engine=object())
"""


def test_a_killed_process_is_resumed_by_the_next_run(ckpt, monkeypatch, tmp_path):
    """SIGKILL mid-run: committed results survive, the advisory lock dies with the process, and the
    next run executes only the samples without a result."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from app.core.db import database_url

    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url()}
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN], env=env, cwd=os.getcwd())
    deadline = time.monotonic() + 60
    done: set = set()
    while time.monotonic() < deadline and len(done) < 3:
        time.sleep(0.1)
        with session_scope() as s:
            run = s.scalars(select(EvalRun)).first()
            done = store.done_keys(s, run.id) if run else set()
        assert proc.poll() is None, "the run finished before it could be killed"
    proc.send_signal(signal.SIGKILL)
    proc.wait(timeout=10)
    with session_scope() as s:
        done = store.done_keys(s, s.scalars(select(EvalRun)).one().id)
    assert 3 <= len(done) < 10

    rest = Sessions()
    monkeypatch.setattr(runner, "run_sample", rest)
    summary = runner.run_suite(ckpt, SUITE, tasks=TASKS, engine=object())
    assert summary.status == "succeeded" and summary.reused == len(done)
    assert set(rest.calls) == {(t.id, s) for t in TASKS for s in range(2)} - done

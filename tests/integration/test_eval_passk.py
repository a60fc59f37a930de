"""pass@k end to end on real Postgres: a suite with k samples per task through the runner (stored
summary, cached re-read), ``gate_candidate`` (every sample paired, pass@k in the report and
tasks.md) and the loop report."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from app.core.db import session_scope
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from evals import gating, runner
from evals.config import SuiteConfig
from evals.gate.policy import GateConfig, SuiteGate
from evals.gating import gate_candidate
from ops.report import collect_report
from tests.integration.test_eval_runner_resume import StubTask

pytestmark = pytest.mark.integration

K = 4
TASKS = [StubTask(id=f"f/{i}") for i in range(12)]
SUITE = SuiteConfig(
    name="functions_stub", version="1", source="humaneval", samples_per_task=K, sampling={"temperature": 0.7}
)
CONFIG = GateConfig(
    suites={"functions_stub": SuiteGate(min_pairs=10, margin=0.3)}, bootstrap_resamples=500, monitors=[]
)


class Samples:
    """Per checkpoint, how many of a task's K samples pass: ``base`` passes samples < task % 3
    (tasks 0, 3, 6, 9 never pass), ``cand`` one sample more on every task."""

    def __init__(self):
        self.calls: list[tuple[str, str, int]] = []
        self.lock = threading.Lock()

    def __call__(self, engine, suite, task, sample_index, work_root, run_id):
        with self.lock:
            self.calls.append((engine.checkpoint_id, task.id, sample_index))
        n = int(task.id.split("/")[1]) % 3 + (engine.checkpoint_id == "cand")
        return {
            "passed": sample_index < n,
            "attempts": 1,
            "turns": 1,
            "completion_tokens": 20,
            "latency_s": 0.1,
            "tool_calls": 1,
            "tool_call_errors": 0,
            "asked_question": False,
            "edited": True,
            "detail": {},
        }


class Engine:
    def __init__(self, checkpoint_id: str):
        self.checkpoint_id = checkpoint_id


def test_k_samples_per_task_are_summarized_paired_and_reported(db, monkeypatch):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        add_checkpoint(s, checkpoint_id="cand", path="/x/cand", parent_id="base", generation=1)
    samples = Samples()
    monkeypatch.setattr(runner, "run_sample", samples)
    monkeypatch.setattr(gating, "load_suite", lambda name: SUITE)

    outcome = gate_candidate(
        "cand", config=CONFIG, suites=["functions_stub"], tasks={"functions_stub": TASKS}, engine_factory=Engine
    )
    assert len(samples.calls) == 2 * len(TASKS) * K

    # base: per task c in {0, 1, 2} of 4 -> pass@1 = 1/4, pass@4 = 8/12, best-of-4 8/12.
    base = outcome.runs["functions_stub"]["production"]
    assert base.samples_per_task == K and base.pass_at_k["1"] == pytest.approx(0.25)
    assert base.pass_at_k[str(K)] == pytest.approx(8 / 12) and base.best_of_k == pytest.approx(8 / 12)
    cand = outcome.runs["functions_stub"]["candidate"]
    assert cand.pass_at_k["1"] == pytest.approx(0.5) and cand.best_of_k == 1.0

    s = outcome.result.suites["functions_stub"]
    assert s.n_pairs == len(TASKS) * K and s.n_tasks == len(TASKS) and s.samples_per_task == K
    assert s.diff == pytest.approx(0.25) and s.diff_low > 0
    assert s.production_sampling.best_of_k_tasks == 8 and s.candidate_sampling.best_of_k_tasks == 12
    assert outcome.result.passed, [r.message for r in outcome.result.failures()]
    ni = next(r for r in outcome.result.reasons if r.check == "non_inferiority")
    assert f"12 tasks x {K} samples" in ni.message

    report = json.loads((Path(outcome.report_path) / "report.json").read_text())
    assert report["suites"]["functions_stub"]["candidate_sampling"]["pass_at_k"] == {"1": 0.5, "4": 1.0}
    tasks_md = (Path(outcome.report_path) / "tasks.md").read_text()
    assert "candidate: pass@1 50.0% · pass@4 100.0% · best-of-4 100.0% (12 tasks x 4 samples)" in tasks_md

    # A cached run reads pass@k back from the stored summary.
    again = runner.run_suite("base", SUITE, tasks=TASKS, engine=Engine("base"))
    assert again.cached and again.pass_at_k == base.pass_at_k and again.best_of_k == base.best_of_k

    with session_scope() as session:
        loop = collect_report(session, "cand")
    by_ckpt = {r.checkpoint_id: r for r in loop.suites if r.suite == "functions_stub"}
    assert by_ckpt["base"].pass_at_k == pytest.approx({"1": 0.25, "4": 8 / 12})
    assert by_ckpt["cand"].pass_at_k_text == "pass@1 50.0% · pass@4 100.0% · best-of-4 100.0%"

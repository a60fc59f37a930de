"""``early_stop`` end to end on real Postgres: the candidate's run stops once the confidence
sequence decides (status ``stopped``, fewer sessions than the plan), the stored decision says where,
a close candidate runs its whole suite, and a stopped run is completed when its checkpoint is later
the production side of a gate.

Sessions are stubbed per checkpoint (the harness path is covered by ``test_eval_harness.py``).
"""

from __future__ import annotations

import threading
import uuid

import pytest
from sqlalchemy import select

from app.core.db import session_scope
from app.models import Checkpoint, EvalResult, EvalRun, GateDecision
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from evals import runner
from evals.gate.policy import GateConfig, SuiteGate
from evals.gating import gate_candidate
from tests.integration.test_eval_runner_resume import StubTask

pytestmark = pytest.mark.integration

# 30 templates of 4 tasks, clustered by template as the held-out functions suite is.
TASKS = {"functions": [StubTask(id=f"FN/tpl{t:02d}/{v}") for t in range(30) for v in range(4)]}
PLANNED = 120
CONFIG = GateConfig(
    suites={"functions": SuiteGate(margin=0.045, min_pairs=10)},
    bootstrap_resamples=1000,
    decide_by="sequential",
    early_stop=True,
)


class Engine:
    def __init__(self, checkpoint_id: str):
        self.checkpoint_id = checkpoint_id


class Policies:
    """Per checkpoint, which variants of template ``t`` pass: ``base`` variant 0 of every template
    (25 %), ``good`` 0-2 (+50 points), ``bad`` none (-25 points), ``close`` base's except in four
    templates, two gaining and two losing a task."""

    def solves(self, checkpoint: str, template: int, variant: int) -> bool:
        if checkpoint == "good":
            return variant <= 2
        if checkpoint == "bad":
            return False
        if checkpoint == "close" and template in (0, 2):
            return variant <= 1
        if checkpoint == "close" and template in (1, 3):
            return False
        return variant == 0

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, engine, suite, task, sample_index, work_root, run_id):
        with self.lock:
            self.calls[engine.checkpoint_id] = self.calls.get(engine.checkpoint_id, 0) + 1
        _, template, variant = task.id.split("/")
        return {
            "passed": self.solves(engine.checkpoint_id, int(template[3:]), int(variant)),
            "attempts": 1,
            "turns": 2,
            "completion_tokens": 60,
            "latency_s": 0.1,
            "tool_calls": 2,
            "tool_call_errors": 0,
            "asked_question": False,
            "edited": True,
            "detail": {},
        }


@pytest.fixture
def checkpoints(db):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        for cid in ("good", "bad", "close"):
            add_checkpoint(s, checkpoint_id=cid, path=f"/x/{cid}", parent_id="base", generation=1)


def gate(cid: str, **kw):
    return gate_candidate(
        cid,
        suites=["functions"],
        tasks=TASKS,
        engine_factory=Engine,
        workers=1,
        overrides={"samples_per_task": 1},
        config=CONFIG,
        **kw,
    )


def stored_run(run_id: str) -> tuple[str, int]:
    with session_scope() as s:
        run = s.get(EvalRun, uuid.UUID(run_id))
        n = len(s.scalars(select(EvalResult).where(EvalResult.run_id == run.id)).all())
        return run.status, n


@pytest.mark.parametrize("cid, decision, status", [("good", "pass", "gate_passed"), ("bad", "fail", "gate_failed")])
def test_a_clear_candidate_stops_before_the_end_and_records_where(checkpoints, monkeypatch, cid, decision, status):
    policies = Policies()
    monkeypatch.setattr(runner, "run_sample", policies)
    outcome = gate(cid)
    suite = outcome.result.suites["functions"]
    assert outcome.result.decision == decision, [r.message for r in outcome.result.failures()]
    # Production ran the whole plan (it is reused); the candidate stopped once the sequence decided.
    assert policies.calls["base"] == PLANNED
    summary = outcome.runs["functions"]["candidate"]
    assert summary.status == "stopped" and summary.stopped_at_pairs == suite.stopped_at_pairs
    assert suite.run_stopped and suite.decided_by == "sequential" and suite.planned_pairs == PLANNED
    assert suite.stopped_at_pairs % 4 == 0 and policies.calls[cid] < PLANNED
    # At most the one session in flight past the stop (one worker, two submitted) ran beyond it.
    assert suite.stopped_at_pairs <= policies.calls[cid] <= suite.stopped_at_pairs + 2
    assert stored_run(summary.run_id) == ("stopped", policies.calls[cid])
    with session_scope() as s:
        assert s.get(Checkpoint, cid).status == status
        row = s.get(GateDecision, uuid.UUID(outcome.decision_id))
        stored = row.report["suites"]["functions"]
        assert stored["stopped_at_pairs"] == suite.stopped_at_pairs and stored["run_stopped"] is True
        assert row.report["config"]["early_stop"] is True


def test_a_close_candidate_runs_the_whole_suite(checkpoints, monkeypatch):
    policies = Policies()
    monkeypatch.setattr(runner, "run_sample", policies)
    outcome = gate("close")
    suite = outcome.result.suites["functions"]
    assert policies.calls == {"base": PLANNED, "close": PLANNED}
    assert outcome.runs["functions"]["candidate"].status == "succeeded"
    assert outcome.result.decision == "insufficient_evidence" and suite.stopped_at_pairs is None
    assert not suite.run_stopped and suite.n_pairs == PLANNED


def test_a_stopped_run_is_completed_when_its_checkpoint_is_production(checkpoints, monkeypatch):
    """``good`` stops early as a candidate (a second gate of it reuses the stopped run and runs
    nothing); gated as the production side of ``close`` later, its stopped run is resumed and only
    the samples it skipped run."""
    policies = Policies()
    monkeypatch.setattr(runner, "run_sample", policies)
    first = gate("good")
    skipped = PLANNED - policies.calls["good"]
    assert skipped > 0
    # Gated again: the stopped run is found, its stored results decide at once, nothing runs.
    policies.calls.clear()
    again = gate("good")
    assert policies.calls == {} and again.result.decision == "pass"
    assert again.runs["functions"]["candidate"].run_id == first.runs["functions"]["candidate"].run_id
    assert again.result.suites["functions"].stopped_at_pairs == first.result.suites["functions"].stopped_at_pairs
    second = gate("close", production_id="good")
    assert policies.calls["good"] == skipped
    prod = second.runs["functions"]["production"]
    assert prod.run_id == first.runs["functions"]["candidate"].run_id and prod.status == "succeeded"
    assert stored_run(prod.run_id) == ("succeeded", PLANNED)
    assert second.result.decision == "fail"  # base's rate against good's: a clear loss


def test_the_gate_samples_k_times_at_the_serving_temperature_and_stops_in_whole_clusters(checkpoints, monkeypatch):
    """``samples = 2`` in the policy: both sides run every task twice at 0.7 (the suite's own
    decoding is greedy), the pairs cluster by template, and the candidate still stops early."""
    policies = Policies()
    seen: list[tuple[int, float]] = []

    def sample(engine, suite, task, sample_index, work_root, run_id):
        seen.append((suite.samples_per_task, suite.sampling.temperature))
        return policies(engine, suite, task, sample_index, work_root, run_id)

    monkeypatch.setattr(runner, "run_sample", sample)
    config = CONFIG.model_copy(update={"suites": {"functions": SuiteGate(margin=0.045, min_pairs=10, samples=2)}})
    outcome = gate_candidate("good", suites=["functions"], tasks=TASKS, engine_factory=Engine, workers=1, config=config)
    suite = outcome.result.suites["functions"]
    assert set(seen) == {(2, 0.7)} and policies.calls["base"] == 2 * PLANNED
    assert outcome.result.decision == "pass" and suite.samples_per_task == 2 and suite.planned_pairs == 2 * PLANNED
    assert suite.sequential.clusters == 30 and suite.stopped_at_pairs % 8 == 0 and policies.calls["good"] < 2 * PLANNED
    (power,) = [r for r in outcome.result.reasons if r.check == "power"]
    assert power.details["n"] == 2 * PLANNED and power.details["samples_per_task"] == 2

"""``flywheel gate`` end to end on real Postgres: runs, cached production, decision, status, outbox,
audit, report files; and the Celery wrappers' underlying functions.

Sessions are stubbed per checkpoint (the harness path is covered by ``test_eval_harness.py``).
"""

from __future__ import annotations

import json
import threading
import uuid
from pathlib import Path

import pytest
from sqlalchemy import select

from app.core.db import session_scope
from app.core.errors import ConflictError
from app.models import AuditLog, Checkpoint, EvalRun, GateDecision, Outbox
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from evals import automation, runner
from evals.gate.policy import GateConfig, MonitorBound, SuiteGate
from evals.gating import gate_candidate
from tests.integration.test_eval_runner_resume import StubTask

pytestmark = pytest.mark.integration

TASKS = {
    "humaneval": [StubTask(id=f"HumanEval/{i}") for i in range(30)],
    "dataframebench": [StubTask(id=f"dfb/{i}") for i in range(30)],
}
# 30 tasks cannot power a 2-point margin, so the power rule (tests/unit/test_gate.py and the
# insufficient-evidence test below) is off here: these tests are about what a decision records.
CONFIG = GateConfig(
    suites={"humaneval": SuiteGate(min_pairs=10), "dataframebench": SuiteGate(min_pairs=10)},
    bootstrap_resamples=1000,
    monitors=[MonitorBound(metric="edit_rate", worse="decrease", abs_tolerance=0.05)],
    min_power=0.0,
)


class Engine:
    def __init__(self, checkpoint_id: str):
        self.checkpoint_id = checkpoint_id


class Policies:
    """Per checkpoint: which task numbers pass. ``base`` solves 0-9, ``good`` 0-19, ``bad`` 0-2."""

    solves = {"base": range(10), "good": range(20), "bad": range(3)}

    def __init__(self):
        self.calls: dict[str, int] = {}
        self.lock = threading.Lock()

    def __call__(self, engine, suite, task, sample_index, work_root, run_id):
        with self.lock:
            self.calls[engine.checkpoint_id] = self.calls.get(engine.checkpoint_id, 0) + 1
        n = int(task.id.rsplit("/", 1)[1])
        return {
            "passed": n in self.solves[engine.checkpoint_id],
            "attempts": 1,
            "turns": 3,
            "completion_tokens": 80,
            "latency_s": 0.2,
            "tool_calls": 4,
            "tool_call_errors": 0,
            "asked_question": False,
            "edited": True,
            "detail": {},
        }


@pytest.fixture
def checkpoints(db):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        for cid in ("good", "bad"):
            add_checkpoint(s, checkpoint_id=cid, path=f"/x/{cid}", parent_id="base", generation=1)


def gate(cid: str, **kw):
    # One sample per task whatever the shipped suites say (k samples: tests/integration/test_eval_passk.py).
    return gate_candidate(
        cid,
        suites=sorted(TASKS),
        tasks=TASKS,
        engine_factory=Engine,
        workers=2,
        overrides={"samples_per_task": 1},
        **{"config": CONFIG, **kw},
    )


def test_gate_passes_records_everything_and_caches_production(checkpoints, monkeypatch):
    policies = Policies()
    monkeypatch.setattr(runner, "run_sample", policies)
    outcome = gate("good")
    assert outcome.result.passed, [r.message for r in outcome.result.failures()]
    assert policies.calls == {"base": 60, "good": 60}
    with session_scope() as s:
        assert s.get(Checkpoint, "good").status == "gate_passed"
        decision = s.get(GateDecision, uuid.UUID(outcome.decision_id))
        assert decision.passed and decision.production_id == "base"
        assert {r["check"] for r in decision.reasons} >= {"non_inferiority", "floor", "monitor"}
        assert decision.report["suites"]["humaneval"]["candidate_only"] == 10
        (msg,) = s.scalars(select(Outbox).where(Outbox.event_type == "gate.decided")).all()
        assert msg.key == "good" and msg.payload["passed"] is True
        assert msg.payload["decision_id"] == outcome.decision_id and msg.payload["production_id"] == "base"
        assert s.scalars(select(AuditLog).where(AuditLog.action == "gate.decided")).one().target == "checkpoint:good"
    report_dir = Path(decision.report_path)
    assert {p.name for p in report_dir.iterdir()} >= {"report.json", "gate.png", "tasks.md"}
    report = json.loads((report_dir / "report.json").read_text())
    assert report["passed"] and len(report["task_diff"]["humaneval"]["newly_solved"]) == 10
    assert "HumanEval/15" in (report_dir / "tasks.md").read_text()
    assert (report_dir / "gate.png").read_bytes()[:4] == b"\x89PNG"

    # A second candidate against the same production: production's runs are reused, not re-run.
    policies.calls.clear()
    bad = gate("bad")
    assert policies.calls == {"bad": 60}
    assert all(bad.runs[s]["production"].cached for s in TASKS)
    assert not bad.result.passed
    assert {r.check for r in bad.result.failures()} == {"non_inferiority"}
    with session_scope() as s:
        assert s.get(Checkpoint, "bad").status == "gate_failed"
        assert len(s.scalars(select(EvalRun).where(EvalRun.checkpoint_id == "base")).all()) == 2


def test_a_gated_suite_without_results_fails_closed(checkpoints, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Policies())
    cfg = CONFIG.model_copy(update={"suites": {**CONFIG.suites, "mined": SuiteGate()}})
    outcome = gate_candidate("good", config=cfg, suites=["humaneval"], tasks=TASKS, engine_factory=Engine)
    assert not outcome.result.passed
    assert {(r.suite, r.check) for r in outcome.result.failures()} == {
        ("dataframebench", "missing_suite"),
        ("mined", "missing_suite"),
    }


def test_only_candidates_are_gated(checkpoints, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Policies())
    with pytest.raises(ConflictError, match="production"):
        gate("base")
    with session_scope() as s:
        s.get(Checkpoint, "bad").status = "rejected"
    with pytest.raises(ConflictError, match="rejected"):
        gate("bad")


def test_automation_scans_and_evaluates_each_candidate_once(checkpoints, monkeypatch):
    monkeypatch.setattr(runner, "run_sample", Policies())
    kw = dict(
        config=CONFIG, suites=sorted(TASKS), tasks=TASKS, engine_factory=Engine, overrides={"samples_per_task": 1}
    )
    dispatched: list[str] = []
    assert automation.scan(dispatched.append, limit=10) == ["bad", "good"]
    result = automation.evaluate("good", **kw)
    assert result["passed"] is True and result["decision_id"]
    assert automation.evaluate("good", **kw)["skipped"].startswith("already decided")
    assert automation.scan(dispatched.append, limit=10) == ["bad"]
    assert dispatched == ["bad", "good", "bad"]


def test_celery_tasks_are_thin_wrappers(checkpoints, monkeypatch):
    from app.worker.celery_app import celery_app

    assert {"flywheel.evals.evaluate_candidate", "flywheel.evals.scan_candidates"} <= set(celery_app.tasks)
    gated: list[str] = []
    monkeypatch.setattr(automation, "evaluate", lambda cid: gated.append(cid) or {"checkpoint_id": cid})
    assert automation.evaluate_candidate.apply(args=["good"]).get() == {"checkpoint_id": "good"}
    sent: list[str] = []
    monkeypatch.setattr(automation.evaluate_candidate, "delay", sent.append)
    monkeypatch.setenv("FLYWHEEL_EVAL_SCAN_BATCH", "5")
    assert automation.scan_candidates.apply().get() == ["bad", "good"]
    assert sent == ["bad", "good"] and gated == ["good"]


def test_an_underpowered_gate_records_insufficient_evidence(checkpoints, monkeypatch):
    """``good`` churns: it solves tasks 5-14 where base solves 0-9, so on 30 pairs the interval of
    the difference (0) reaches far below the 2-point margin without the power to call that a
    failure. (The same pairs with a clear gain pass at this power: the gate decides by its interval.)"""
    policies = Policies()
    policies.solves = {**Policies.solves, "good": range(5, 15)}
    monkeypatch.setattr(runner, "run_sample", policies)
    outcome = gate("good", config=CONFIG.model_copy(update={"min_power": 0.8}))
    result = outcome.result
    assert result.decision == "insufficient_evidence" and not result.passed
    assert {r.check for r in result.failures()} == {"non_inferiority"}
    assert all(r.inconclusive for r in result.failures())
    with session_scope() as s:
        assert s.get(Checkpoint, "good").status == "gate_failed"
        decision = s.get(GateDecision, uuid.UUID(outcome.decision_id))
        assert not decision.passed and decision.report["decision"] == "insufficient_evidence"
        for name in TASKS:
            suite = decision.report["suites"][name]
            assert suite["decision"] == "insufficient_evidence" and 0.0 <= suite["power"] < 0.8
        audit = s.scalars(select(AuditLog).where(AuditLog.action == "gate.decided")).one()
        assert audit.details["decision"] == "insufficient_evidence"
        assert set(audit.details["suites"]) == set(TASKS)
        assert audit.details["suites"]["humaneval"]["power"] == decision.report["suites"]["humaneval"]["power"]
        (msg,) = s.scalars(select(Outbox).where(Outbox.event_type == "gate.decided")).all()
        assert msg.payload["decision"] == "insufficient_evidence" and msg.payload["passed"] is False
    report = json.loads((Path(outcome.report_path) / "report.json").read_text())
    assert report["decision"] == "insufficient_evidence"
    assert {n: s["decision"] for n, s in report["suites"].items()} == dict.fromkeys(TASKS, "insufficient_evidence")

"""The release policy on a real database: ``manual`` holds every gated candidate for a person;
``auto_on_pass`` promotes a pass as the audited actor ``release-policy`` (announced on the outbox),
holds insufficient evidence unless an override reason is configured (then promotes with the
audited override), leaves a failed gate alone, and does nothing twice when the Celery gating task
is redelivered."""

from __future__ import annotations

import uuid

import pytest
from sqlalchemy import select

from app.core.db import session_scope
from app.lifecycle.gating import record_gate_decision
from app.lifecycle.release import ReleasePolicy, ReleaseSettings, apply_release_policy
from app.models import AuditLog, Checkpoint, Outbox, Promotion
from evals import automation, runner
from evals.gating import gate_candidate
from tests.integration.test_api_support import base, seed_checkpoint, store  # noqa: F401
from tests.integration.test_eval_gating import CONFIG, TASKS, Engine, Policies

pytestmark = pytest.mark.integration

AUTO = ReleaseSettings(policy=ReleasePolicy.AUTO_ON_PASS)
OVERRIDE = "release manager on call: the canary is the evidence for this product (ticket REL-7)"


@pytest.fixture
def candidate(session, store, base):  # noqa: F811  (fixtures)
    return seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)


def decide(checkpoint_id: str, decision: str) -> None:
    """Record a gate decision against base as the gate does (its own committed transaction)."""
    with session_scope() as s:
        record_gate_decision(
            s,
            decision_id=uuid.uuid4(),
            candidate_id=checkpoint_id,
            production_id="base",
            decision=decision,
            reasons=[] if decision == "pass" else [{"check": "power", "passed": False, "message": "functions: power"}],
            report={"decision": decision},
            report_path=None,
            failures=[] if decision == "pass" else ["functions: power"],
        )


def release(checkpoint_id: str, settings: ReleaseSettings):
    with session_scope() as s:
        return apply_release_policy(s, checkpoint_id, settings)


def state(checkpoint_id: str) -> tuple[str, str | None, int, list[Outbox]]:
    """(status, decision, promotions, checkpoint.promoted messages) of a checkpoint."""
    with session_scope() as s:
        row = s.get(Checkpoint, checkpoint_id)
        promotions = len(s.scalars(select(Promotion).where(Promotion.checkpoint_id == checkpoint_id)).all())
        promoted = s.scalars(
            select(Outbox).where(Outbox.event_type == "checkpoint.promoted", Outbox.key == checkpoint_id)
        ).all()
        s.expunge_all()
        return row.status, row.decision, promotions, list(promoted)


def test_manual_holds_a_passed_candidate_for_a_release_manager(candidate):
    decide(candidate.id, "pass")
    action = release(candidate.id, ReleaseSettings())
    assert action.outcome == "held" and "manual" in action.reasons[0]
    assert state(candidate.id)[:3] == ("gate_passed", "pass", 0)


def test_auto_on_pass_promotes_a_pass_as_an_audited_actor_and_announces_it(candidate):
    decide(candidate.id, "pass")
    action = release(candidate.id, AUTO)
    assert action.outcome == "promoted" and action.promotion_id
    status, decision, promotions, (message,) = state(candidate.id)
    assert (status, decision, promotions) == ("production", "pass", 1)
    assert message.payload["actor"] == "release-policy" and message.payload["gate_decision"] == "pass"
    assert message.payload["previous_production_id"] == "base"
    with session_scope() as s:
        audit = s.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.promoted")).one()
        assert audit.actor == "release-policy" and "auto_on_pass" in audit.details["reason"]
        assert s.get(Checkpoint, "base").status == "retired"
    # applied again (a redelivered task): nothing is written twice
    assert release(candidate.id, AUTO).outcome == "skipped"
    assert state(candidate.id)[2] == 1 and len(state(candidate.id)[3]) == 1


def test_auto_on_pass_holds_insufficient_evidence_for_a_person(candidate):
    decide(candidate.id, "insufficient_evidence")
    action = release(candidate.id, AUTO)
    assert action.outcome == "held" and "FLYWHEEL_RELEASE_OVERRIDE_INSUFFICIENT" in action.reasons[0]
    assert state(candidate.id)[:3] == ("gate_failed", "insufficient_evidence", 0)


def test_a_configured_override_promotes_insufficient_evidence_with_the_audited_reason(candidate):
    decide(candidate.id, "insufficient_evidence")
    action = release(candidate.id, AUTO.model_copy(update={"override_insufficient": OVERRIDE}))
    assert action.outcome == "overridden"
    status, decision, promotions, (message,) = state(candidate.id)
    assert (status, decision, promotions) == ("production", "overridden", 1)
    assert message.payload["override_reason"] == OVERRIDE
    assert message.payload["gate_decision"] == "insufficient_evidence"
    with session_scope() as s:
        override = s.scalars(select(AuditLog).where(AuditLog.action == "gate.overridden")).one()
        assert override.actor == "release-policy" and override.target == f"checkpoint:{candidate.id}"
        assert override.details["override_reason"] == OVERRIDE
        assert override.details["decision"] == "insufficient_evidence"


def test_a_failed_gate_is_left_as_the_gate_left_it(candidate):
    decide(candidate.id, "fail")
    settings = AUTO.model_copy(update={"override_insufficient": OVERRIDE})  # an override never covers a fail
    action = release(candidate.id, settings)
    assert action.outcome == "left"
    assert state(candidate.id)[:3] == ("gate_failed", "fail", 0)


def test_a_stale_gate_is_held_with_the_promotions_refusals(candidate, session, store):  # noqa: F811
    decide(candidate.id, "pass")
    other = seed_checkpoint(session, store, "ckpt-0002", parent_id="base", generation=1)
    decide(other.id, "pass")
    assert release(other.id, AUTO).outcome == "promoted"
    action = release(candidate.id, AUTO)  # its gate compared against base, which left production
    assert action.outcome == "held" and any("re-run the gate" in r for r in action.reasons)
    assert state(candidate.id)[:3] == ("gate_passed", "pass", 0)


def test_the_celery_gating_path_applies_the_policy_once_even_when_redelivered(candidate, monkeypatch):
    """``evaluate`` (the task's body) gates, commits, then releases; a task redelivered after a
    crash between the two commits finds the decision and completes the release, and a third
    delivery changes nothing."""
    monkeypatch.setattr(Policies, "solves", {**Policies.solves, candidate.id: range(20)})
    monkeypatch.setattr(runner, "run_sample", Policies())
    kw = dict(
        config=CONFIG, suites=sorted(TASKS), tasks=TASKS, engine_factory=Engine, overrides={"samples_per_task": 1}
    )
    gate_candidate(candidate.id, **kw)  # the gate committed; the worker died before the release
    assert state(candidate.id)[:3] == ("gate_passed", "pass", 0)
    redelivered = automation.evaluate(candidate.id, release_policy=AUTO, **kw)
    assert redelivered["skipped"].startswith("already decided")
    assert redelivered["release"]["outcome"] == "promoted"
    again = automation.evaluate(candidate.id, release_policy=AUTO, **kw)
    assert again["release"]["outcome"] == "skipped"
    assert state(candidate.id)[2] == 1 and len(state(candidate.id)[3]) == 1

"""Recording a gate's decision on a candidate: the ``gated`` change of a checkpoint's life.

Invariants (in the caller's ONE transaction, flushed, never committed):

- the ``gate_decision`` row, the checkpoint's new ``status`` (``gate_passed`` for a ``pass``,
  ``gate_failed`` for ``fail``, ``insufficient_evidence`` or ``not_gated``), its ``decision``
  column (what the gate found, so no reader re-parses a report), a ``gate.decided`` audit entry
  and a ``gate.decided`` lifecycle message are written together;
- the checkpoint row is locked ``FOR UPDATE`` and must still be gateable (``candidate``,
  ``gate_passed`` or ``gate_failed``): a candidate promoted or rejected while the gate ran is
  refused, not overwritten.
"""

from __future__ import annotations

import uuid
from typing import Any

from sqlalchemy.orm import Session

from app.core.errors import ConflictError
from app.lifecycle.messages import GateDecided
from app.lifecycle.production import lock_checkpoint
from app.lifecycle.status import GATEABLE, GateVerdict, move, status_after_gate
from app.models import GateDecision
from app.outbox.lifecycle import enqueue_lifecycle
from app.repositories.audit import record_audit

GATE_ACTOR = "evals:gate"


def record_gate_decision(
    session: Session,
    *,
    decision_id: uuid.UUID,
    candidate_id: str,
    production_id: str,
    decision: str,
    reasons: list[dict[str, Any]],
    report: dict[str, Any],
    report_path: str | None,
    failures: list[str],
    suites: dict[str, dict[str, Any]] | None = None,
    actor: str = GATE_ACTOR,
) -> GateDecision:
    """Store a gate's decision on ``candidate_id`` and move its status (see module invariants).

    Args:
        decision: ``evals.gate.models.GateResult.decision``: ``pass``, ``fail``, ``insufficient_evidence``
            or ``not_gated``.
        reasons: the gate's reasons as JSON (``GateReason.model_dump(mode="json")``).
        report: the gate report (with its config and trace reference) stored on the row.
        failures: the messages of the reasons that failed (the first 20 are kept in the message).
        suites: ``{suite: {"decision", "power"}}`` of the gated suites, for the audit entry.

    Raises:
        ValueError: ``decision`` is not a gate decision.
        NotFoundError: no such checkpoint.
        ConflictError: the checkpoint is no longer gateable (promoted or rejected meanwhile).
    """
    verdict = GateVerdict(decision)
    target = status_after_gate(verdict)
    row = lock_checkpoint(session, candidate_id)
    if row.status not in GATEABLE:
        raise ConflictError(f"checkpoint {candidate_id} became {row.status} during the gate")
    gate = GateDecision(
        id=decision_id,
        candidate_id=candidate_id,
        production_id=production_id,
        passed=verdict is GateVerdict.PASS,
        decision=verdict.value,
        reasons=reasons,
        report=report,
        report_path=report_path,
    )
    session.add(gate)
    previous = move(row, target)
    row.decision = verdict.value
    session.flush()
    details = {
        "decision_id": str(decision_id),
        "production_id": production_id,
        "passed": gate.passed,
        "decision": verdict.value,
        "suites": suites or {},
        "previous_status": previous,
        "failures": failures[:20],
        "report_path": report_path,
    }
    record_audit(session, actor=actor, action="gate.decided", target=f"checkpoint:{candidate_id}", details=details)
    message = GateDecided(
        checkpoint_id=candidate_id,
        actor=actor,
        production_id=production_id,
        decision_id=str(decision_id),
        decision=verdict,
        passed=gate.passed,
        failures=failures[:20],
        report_path=report_path,
    )
    enqueue_lifecycle(session, message)
    return gate

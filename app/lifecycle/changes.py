"""Promotion, rollback and rejection of checkpoints: the production changes of a checkpoint's life.

Invariants (with the database's help):

- exactly one checkpoint is ``production``: production changes are serialised by a transaction-
  scoped advisory lock, the production row is locked ``FOR UPDATE``, and the partial unique index
  ``uq_checkpoint_one_production`` refuses a second one whatever happens;
- a promotion needs a passed gate (the latest ``gate_decision`` for the candidate decided ``pass``,
  against the checkpoint that is production now, and its status is ``gate_passed``), a STABLE
  directory, and the caller's ``expected_production_id`` equal to the current production
  (optimistic concurrency: of two concurrent promotions exactly one wins, the other gets a 409);
- a gate that ended ``insufficient_evidence`` or ``not_gated`` (nothing failed, but nothing showed
  the candidate is better) is not a pass: only a written ``override_reason`` (from a caller the
  boundary checked for the ``override`` permission, or the release policy where an operator
  configured one) promotes over it; the override is its own ``gate.overridden`` audit entry beside
  ``checkpoint.promoted`` and leaves the checkpoint's ``decision`` ``overridden``. A failed gate
  has no override;
- when the gate's stored config says ``[online] required``, a promotion also needs a canary of the
  candidate against this production in which no online signal regressed significantly, with
  enough sessions on both arms (``app.lifecycle.online``; fails closed);
- each change writes, in the caller's ONE transaction: the ``promotion`` row, the status changes
  (along ``app.lifecycle.status.TRANSITIONS``), an ``audit_log`` entry and an outbox lifecycle
  message; it also stops the active canary (its comparison was against the production that leaves).

Functions flush and never commit: the boundary (HTTP request, CLI command, Celery task) commits.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.errors import ConflictError
from app.core.telemetry import link_references
from app.lifecycle.canary import end_canary_for_change
from app.lifecycle.messages import CheckpointRejected, ProductionChanged
from app.lifecycle.online import online_reasons
from app.lifecycle.online_stats import OnlinePolicy
from app.lifecycle.production import (
    check_clean,
    latest_gate_decision,
    lock_checkpoint,
    lock_production,
    serving_lineage,
    stale_gate_reason,
)
from app.lifecycle.status import OVERRIDABLE, REJECTABLE, CheckpointStatus, GateVerdict, move
from app.models import Checkpoint, GateDecision, Promotion
from app.outbox.lifecycle import enqueue_lifecycle
from app.repositories.audit import record_audit


@dataclass(frozen=True)
class ProductionChange:
    """The outcome of a promotion or rollback."""

    promotion: Promotion
    checkpoint: Checkpoint
    previous: Checkpoint | None


def gate_refusals(gate: GateDecision) -> list[str]:
    """The messages of the reasons that kept a gated suite from passing (``evals.gate.models.GateReason``
    dicts, or plain strings); the informational power figure never is one."""
    return [
        r.get("message", str(r)) if isinstance(r, dict) else str(r)
        for r in gate.reasons or []
        if not isinstance(r, dict)
        or (not r.get("passed") and r.get("gated", True) and not r.get("informational", False))
    ]


def _gated_powers(gate: GateDecision) -> dict[str, dict[str, Any]]:
    """Each gated suite's decision and power from the stored report."""
    suites = (gate.report or {}).get("suites") or {}
    return {n: {"decision": s.get("decision"), "power": s.get("power")} for n, s in suites.items() if s.get("gated")}


def _switch_production(session: Session, *, new: Checkpoint, previous: Checkpoint | None) -> None:
    if previous is not None:
        move(previous, CheckpointStatus.RETIRED)
        session.flush()  # the partial unique index must see the old row leave 'production' first
    move(new, CheckpointStatus.PRODUCTION)
    new.promoted_at = datetime.now(UTC)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:  # a writer that bypassed the advisory lock made another production
        raise ConflictError(
            "another checkpoint became production concurrently",
            reasons=["retry with the current production as expected_production_id"],
        ) from None


def _check_servable(row: Checkpoint, current: Checkpoint | None, expected: str | None, reasons: list[str]) -> None:
    """Refusals shared by promotion and rollback: the target must be STABLE, clean of erased data,
    and ``expected`` must name the current production (optimistic concurrency)."""
    check_clean(row, reasons)
    current_id = current.id if current else None
    if expected != current_id:
        reasons.append(f"expected production {expected!r} but production is {current_id!r}")


def _commit_production_change(
    session: Session,
    *,
    kind: str,
    action: Literal["checkpoint.promoted", "checkpoint.rolled_back"],
    row: Checkpoint,
    current: Checkpoint | None,
    actor: str,
    reason: str,
    gate: GateDecision | None = None,
    override_reason: str | None = None,
) -> ProductionChange:
    """The one transaction shape of every production change: status switch, promotion row, audit
    entry and lifecycle outbox row, all in the caller's transaction."""
    gate_decision_id = gate.id if gate is not None else None
    end_canary_for_change(session, actor=actor, new_production_id=row.id)
    _switch_production(session, new=row, previous=current)
    promo = Promotion(
        id=uuid.uuid4(),
        kind=kind,
        checkpoint_id=row.id,
        previous_production_id=current.id if current else None,
        actor=actor,
        reason=reason,
        gate_decision_id=gate_decision_id,
    )
    session.add(promo)
    session.flush()
    message = ProductionChanged(
        type=action,
        checkpoint_id=row.id,
        actor=actor,
        reason=reason,
        promotion_id=str(promo.id),
        previous_production_id=promo.previous_production_id,
        gate_decision_id=str(gate_decision_id) if gate_decision_id else None,
        gate_decision=GateVerdict(gate.decision) if gate is not None else None,
        override_reason=override_reason,
        path=row.path,
        parent_id=row.parent_id,
        lineage=serving_lineage(session, row),
    )
    audited = {"reason", "promotion_id", "previous_production_id"}
    if gate is not None:
        audited |= {"gate_decision_id", "gate_decision"}
    if override_reason is not None:
        audited.add("override_reason")
    details = message.model_dump(mode="json", include=audited)
    record_audit(session, actor=actor, action=action, target=f"checkpoint:{row.id}", details=details)
    enqueue_lifecycle(session, message)
    return ProductionChange(promotion=promo, checkpoint=row, previous=current)


def promotion_refusals(
    session: Session,
    row: Checkpoint,
    current: Checkpoint | None,
    gate: GateDecision | None,
    *,
    override_reason: str | None,
    expected_production_id: str | None,
) -> list[str]:
    """Every reason ``row`` may not be promoted now (empty: it may; see the module invariants)."""
    reasons: list[str] = []
    outcome = gate.decision if gate is not None else None
    overriding = override_reason is not None and outcome in OVERRIDABLE
    if gate is None:
        reasons.append("no gate decision: the candidate has not been evaluated")
    else:
        link_references([((gate.report or {}).get("trace"), {"flywheel.link": "gate_decision"})])
        if outcome in OVERRIDABLE and not overriding:
            found = (
                "found insufficient evidence"
                if outcome == GateVerdict.INSUFFICIENT_EVIDENCE
                else "had no suite to gate"
            )
            reasons.append(
                f"the latest gate {found}: "
                + "; ".join(gate_refusals(gate))
                + " (a release manager may promote over it with a written override_reason)"
            )
        elif outcome not in OVERRIDABLE and outcome != GateVerdict.PASS:
            reasons.append("the latest gate decision failed: " + "; ".join(gate_refusals(gate)))
        if override_reason is not None and not overriding:
            reasons.append(
                f"override_reason applies only to a gate that ended {' or '.join(OVERRIDABLE)}; this one is {outcome}"
            )
        stale = stale_gate_reason(gate, current)
        if stale:
            reasons.append(stale)
        policy = OnlinePolicy.from_config((gate.report or {}).get("config"))
        reasons.extend(online_reasons(session, row.id, current.id if current else None, policy))
    wanted = CheckpointStatus.GATE_FAILED if outcome in OVERRIDABLE else CheckpointStatus.GATE_PASSED
    if row.status != wanted:
        reasons.append(f"checkpoint status is {row.status!r}, not {wanted.value!r}")
    _check_servable(row, current, expected_production_id, reasons)
    return reasons


def promote_checkpoint(
    session: Session,
    *,
    checkpoint_id: str,
    expected_production_id: str | None,
    actor: str,
    reason: str,
    override_reason: str | None = None,
) -> ProductionChange:
    """Make a gate-passed, STABLE candidate the production checkpoint (see module invariants).

    Args:
        override_reason: a written reason to promote a candidate whose latest gate ended
            ``insufficient_evidence`` or ``not_gated`` (the caller checked the ``override``
            permission); recorded as a ``gate.overridden`` audit entry. Refused for any other outcome.

    Raises:
        NotFoundError: no such checkpoint.
        ConflictError: with every reason the promotion is refused (gate missing/failed/stale,
            insufficient evidence without an override, an override of a gate that did not end
            insufficient_evidence, wrong status, not STABLE, trained on erased data, stale
            ``expected_production_id``, and, when the online policy is required, no canary, too few
            sessions or a signal of the canary that regressed significantly).
    """
    current = lock_production(session)
    row = lock_checkpoint(session, checkpoint_id)
    if current is not None and current.id == row.id:
        raise ConflictError(f"checkpoint {row.id} is already production", reasons=["already production"])
    gate = latest_gate_decision(session, row.id)
    reasons = promotion_refusals(
        session, row, current, gate, override_reason=override_reason, expected_production_id=expected_production_id
    )
    if reasons:
        raise ConflictError(f"promotion of {row.id} refused", reasons=reasons)
    assert gate is not None  # no gate is a refusal above
    if override_reason is not None:  # the refusals above admit one only over an overridable gate
        row.decision = GateVerdict.OVERRIDDEN.value
        record_audit(
            session,
            actor=actor,
            action="gate.overridden",
            target=f"checkpoint:{row.id}",
            details={
                "gate_decision_id": str(gate.id),
                "decision": gate.decision,
                "override_reason": override_reason,
                "suites": _gated_powers(gate),
                "refusals": gate_refusals(gate)[:20],
            },
        )
    return _commit_production_change(
        session,
        kind="promotion",
        action="checkpoint.promoted",
        row=row,
        current=current,
        actor=actor,
        reason=reason,
        gate=gate,
        override_reason=override_reason,
    )


def earlier_productions(session: Session) -> set[str]:
    """Ids of every checkpoint that has been production (per the promotion history)."""
    ids = set(session.scalars(select(Promotion.checkpoint_id)))
    ids |= {i for i in session.scalars(select(Promotion.previous_production_id)) if i}
    return ids


def previous_production_id(session: Session, current_id: str) -> str | None:
    """The checkpoint production had before ``current_id`` became production (latest change)."""
    return session.scalar(
        select(Promotion.previous_production_id)
        .where(Promotion.checkpoint_id == current_id)
        .order_by(Promotion.created_at.desc())
        .limit(1)
    )


def rollback_production(
    session: Session, *, expected_production_id: str | None, actor: str, reason: str, checkpoint_id: str | None = None
) -> ProductionChange:
    """Return production to an earlier production checkpoint (default: the one before the current).

    No gate is required (the target served before), but it must still be STABLE and clean.

    Raises:
        NotFoundError: the named checkpoint does not exist.
        ConflictError: no production or no earlier production, the target never was production, is
            not STABLE or trained on erased data, or ``expected_production_id`` is stale.
    """
    current = lock_production(session)
    reasons: list[str] = []
    if current is None:
        raise ConflictError("nothing to roll back: no production checkpoint")
    target_id = checkpoint_id or previous_production_id(session, current.id)
    if target_id is None:
        raise ConflictError(
            f"no earlier production checkpoint before {current.id}", reasons=["production has never changed"]
        )
    row = lock_checkpoint(session, target_id)
    if row.id == current.id:
        reasons.append(f"{row.id} is already production")
    elif row.id not in earlier_productions(session):
        reasons.append(f"{row.id} has never been production")
    if row.status not in (CheckpointStatus.RETIRED, CheckpointStatus.PRODUCTION):
        reasons.append(f"checkpoint status is {row.status!r}, not 'retired'")
    _check_servable(row, current, expected_production_id, reasons)
    if reasons:
        raise ConflictError(f"rollback to {row.id} refused", reasons=reasons)
    return _commit_production_change(
        session, kind="rollback", action="checkpoint.rolled_back", row=row, current=current, actor=actor, reason=reason
    )


def reject_checkpoint(session: Session, *, checkpoint_id: str, actor: str, reason: str) -> Checkpoint:
    """Take a checkpoint out of the running for good (status ``rejected``).

    Raises:
        NotFoundError: no such checkpoint.
        ConflictError: it is production, retired or already rejected.
    """
    row = lock_checkpoint(session, checkpoint_id)
    if row.status not in REJECTABLE:
        raise ConflictError(
            f"cannot reject {row.id}",
            reasons=[f"status is {row.status!r}; only {', '.join(REJECTABLE)} can be rejected"],
        )
    previous_status = move(row, CheckpointStatus.REJECTED)
    session.flush()
    details = {"reason": reason, "previous_status": previous_status}
    record_audit(session, actor=actor, action="checkpoint.rejected", target=f"checkpoint:{row.id}", details=details)
    message = CheckpointRejected(checkpoint_id=row.id, actor=actor, reason=reason, previous_status=previous_status)
    enqueue_lifecycle(session, message)
    return row

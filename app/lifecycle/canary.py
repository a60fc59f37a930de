"""Starting and ending a canary: the transactions behind ``/v1/canaries``, ``flywheel canary``, the
canary policy (``app.promotion.canary_policy``) and every production change.

Invariants (with the database's help):

- at most one canary is ``active``: canary changes take the same transaction-scoped advisory lock
  as production changes (so a canary never starts against a production that is being replaced),
  the active row is locked ``FOR UPDATE``, and the partial unique index ``uq_canary_one_active``
  refuses a second one whatever happens;
- only a gated candidate is canaried: the latest ``gate_decision`` passed against the checkpoint
  that is production now, the status is ``gate_passed``, the directory is STABLE and it did not
  train on erased data;
- each change writes, in the caller's ONE transaction: the ``canary`` row, an ``audit_log`` entry
  and a ``canary.started`` / ``canary.stopped`` outbox message (the serving watcher follows them);
- a production change ends the active canary in the same transaction (:func:`end_canary_for_change`):
  its comparison was against the production that just left; the canary policy
  (``app.promotion.canary_policy``) and an erasure that flags the canary's checkpoint
  (``app.lifecycle.erasure``) stop it through :func:`stop_canary`, audited like any stop.

Functions flush and never commit: the boundary (HTTP request, CLI command) commits. No FastAPI here.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.errors import ConflictError, NotFoundError
from app.core.telemetry import traced
from app.lifecycle.messages import CanaryStarted, CanaryStopped
from app.lifecycle.production import (
    check_clean,
    latest_gate_decision,
    lock_checkpoint,
    lock_production,
    serving_lineage,
    stale_gate_reason,
)
from app.lifecycle.status import CheckpointStatus, GateVerdict
from app.models import Canary, Checkpoint
from app.outbox.lifecycle import enqueue_lifecycle
from app.repositories.audit import record_audit


def get_active_canary(session: Session, *, for_update: bool = False) -> Canary | None:
    """The active canary, or None (locked ``FOR UPDATE`` when asked)."""
    stmt = select(Canary).where(Canary.status == "active")
    if for_update:
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    return session.scalars(stmt).one_or_none()


def get_canary(session: Session, canary_id: uuid.UUID, *, for_update: bool = False) -> Canary:
    """One canary by id.

    Raises:
        NotFoundError: no such canary.
    """
    stmt = select(Canary).where(Canary.id == canary_id)
    if for_update:
        stmt = stmt.with_for_update().execution_options(populate_existing=True)
    row = session.scalars(stmt).one_or_none()
    if row is None:
        raise NotFoundError(f"canary {canary_id} not found")
    return row


def list_canaries(session: Session, *, checkpoint_id: str | None = None, limit: int = 50) -> list[Canary]:
    """Canaries newest first, optionally only those of one checkpoint."""
    stmt = select(Canary).order_by(Canary.started_at.desc(), Canary.id).limit(limit)
    if checkpoint_id is not None:
        stmt = stmt.where(Canary.checkpoint_id == checkpoint_id)
    return list(session.scalars(stmt))


def _check_gated(session: Session, row: Checkpoint, current: Checkpoint | None, reasons: list[str]) -> uuid.UUID | None:
    """Refusal reasons of a checkpoint that is not a gated candidate of the current production."""
    gate = latest_gate_decision(session, row.id)
    if gate is None:
        reasons.append("no gate decision: the candidate has not been evaluated")
    else:
        if gate.decision != GateVerdict.PASS:
            reasons.append(f"the latest gate decided {gate.decision}, not pass")
        stale = stale_gate_reason(gate, current)
        if stale:
            reasons.append(stale)
    if row.status != CheckpointStatus.GATE_PASSED:
        reasons.append(f"checkpoint status is {row.status!r}, not 'gate_passed'")
    check_clean(row, reasons)
    return gate.id if gate else None


@traced("canary.start", attrs=("checkpoint_id", "fraction", "actor"))
def start_canary(session: Session, *, checkpoint_id: str, fraction: float, actor: str, reason: str) -> Canary:
    """Serve a gate-passed candidate to ``fraction`` of users (sticky by user) beside production.

    Args:
        fraction: share of users in the canary arm, strictly between 0 and 1.

    Raises:
        ValueError: ``fraction`` not in (0, 1) (the API validates it first: 422).
        NotFoundError: no such checkpoint.
        ConflictError: with every reason it is refused (a canary is already active, no production,
            the checkpoint is production, its gate is missing/failed/stale, wrong status, not
            STABLE, trained on erased data).
    """
    if not 0.0 < fraction < 1.0:
        raise ValueError(f"canary fraction must be in (0, 1), got {fraction}")
    current = lock_production(session)
    row = lock_checkpoint(session, checkpoint_id)
    if current is not None and current.id == row.id:
        raise ConflictError(f"checkpoint {row.id} is production", reasons=["production cannot be its own canary"])
    reasons: list[str] = []
    if current is None:
        reasons.append("no production checkpoint to compare the canary with")
    active = get_active_canary(session, for_update=True)
    if active is not None:
        reasons.append(f"canary {active.id} of {active.checkpoint_id} is active: stop it first")
    gate_id = _check_gated(session, row, current, reasons)
    if reasons:
        raise ConflictError(f"canary of {row.id} refused", reasons=reasons)
    assert current is not None  # no production is a refusal above
    canary = Canary(
        id=uuid.uuid4(),
        checkpoint_id=row.id,
        production_id=current.id,
        fraction=fraction,
        status="active",
        actor=actor,
        reason=reason,
        gate_decision_id=gate_id,
    )
    session.add(canary)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:  # a writer that bypassed the advisory lock started another canary
        raise ConflictError("another canary became active concurrently", reasons=["stop it first"]) from None
    message = CanaryStarted(
        checkpoint_id=row.id,
        actor=actor,
        reason=reason,
        canary_id=str(canary.id),
        fraction=fraction,
        production_id=current.id,
        gate_decision_id=str(gate_id) if gate_id else None,
        path=row.path,
        parent_id=row.parent_id,
        lineage=serving_lineage(session, row),
    )
    details = message.model_dump(
        mode="json", include={"reason", "canary_id", "fraction", "production_id", "gate_decision_id"}
    )
    record_audit(session, actor=actor, action="canary.started", target=f"checkpoint:{row.id}", details=details)
    enqueue_lifecycle(session, message)
    return canary


def _stop(session: Session, canary: Canary, *, actor: str, reason: str) -> Canary:
    canary.status = "stopped"
    canary.stopped_at = datetime.now(UTC)
    canary.stopped_by = actor
    canary.stop_reason = reason
    session.flush()
    message = CanaryStopped(
        checkpoint_id=canary.checkpoint_id,
        actor=actor,
        reason=reason,
        canary_id=str(canary.id),
        production_id=canary.production_id,
    )
    details = message.model_dump(mode="json", include={"reason", "canary_id", "production_id"})
    record_audit(
        session, actor=actor, action="canary.stopped", target=f"checkpoint:{canary.checkpoint_id}", details=details
    )
    enqueue_lifecycle(session, message)
    return canary


@traced("canary.stop", attrs=("actor",))
def stop_canary(session: Session, *, actor: str, reason: str, canary_id: uuid.UUID | None = None) -> Canary:
    """Stop a canary (default: the active one): every user is served by production again.

    Raises:
        NotFoundError: no such canary, or none active when no id is given.
        ConflictError: the named canary is already stopped.
    """
    lock_production(session)
    if canary_id is None:
        canary = get_active_canary(session, for_update=True)
        if canary is None:
            raise NotFoundError("no active canary")
    else:
        canary = get_canary(session, canary_id, for_update=True)
    if canary.status != "active":
        raise ConflictError(
            f"canary {canary.id} is already {canary.status}",
            reasons=[f"stopped at {canary.stopped_at} by {canary.stopped_by}"],
        )
    return _stop(session, canary, actor=actor, reason=reason)


def end_canary_for_change(session: Session, *, actor: str, new_production_id: str) -> Canary | None:
    """Stop the active canary because production is changing (caller holds the production lock).

    The stop is audited and announced like any other, its reason naming the change.
    """
    canary = get_active_canary(session, for_update=True)
    if canary is None:
        return None
    what = (
        "the canary was promoted"
        if canary.checkpoint_id == new_production_id
        else f"production became {new_production_id}"
    )
    return _stop(session, canary, actor=actor, reason=f"production changed: {what}")

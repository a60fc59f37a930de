"""The API-facing service of production changes: what ``/v1/promotions``, ``/v1/checkpoints/{id}/
reject`` and ``flywheel promote`` call.

Each function is the traced entry point (span ``promotion.*``) of one change of a checkpoint's
life in ``app.lifecycle.changes``, which holds the rules, the locks, the refusals and the writes
(the ``promotion`` row, the status moves, the audit entry, the outbox message). The caller (the
HTTP request, the CLI command) checks the ``override`` permission first and commits.
"""

from __future__ import annotations

from sqlalchemy.orm import Session

from app.core.telemetry import traced
from app.lifecycle import changes
from app.lifecycle.changes import ProductionChange
from app.models import Checkpoint

__all__ = ["ProductionChange", "promote_checkpoint", "reject_checkpoint", "rollback_production"]


@traced("promotion.promote", attrs=("checkpoint_id", "expected_production_id", "actor"))
def promote_checkpoint(
    session: Session,
    *,
    checkpoint_id: str,
    expected_production_id: str | None,
    actor: str,
    reason: str,
    override_reason: str | None = None,
) -> ProductionChange:
    """Promote ``checkpoint_id`` (:func:`app.lifecycle.changes.promote_checkpoint`: its errors)."""
    return changes.promote_checkpoint(
        session,
        checkpoint_id=checkpoint_id,
        expected_production_id=expected_production_id,
        actor=actor,
        reason=reason,
        override_reason=override_reason,
    )


@traced("promotion.rollback", attrs=("expected_production_id", "actor"))
def rollback_production(
    session: Session, *, expected_production_id: str | None, actor: str, reason: str, checkpoint_id: str | None = None
) -> ProductionChange:
    """Roll production back (:func:`app.lifecycle.changes.rollback_production`: its errors)."""
    return changes.rollback_production(
        session, expected_production_id=expected_production_id, actor=actor, reason=reason, checkpoint_id=checkpoint_id
    )


@traced("promotion.reject", attrs=("checkpoint_id", "actor"))
def reject_checkpoint(session: Session, *, checkpoint_id: str, actor: str, reason: str) -> Checkpoint:
    """Reject ``checkpoint_id`` (:func:`app.lifecycle.changes.reject_checkpoint`: its errors)."""
    return changes.reject_checkpoint(session, checkpoint_id=checkpoint_id, actor=actor, reason=reason)

"""The append-only audit log: who changed what, when, and why.

Invariant: rows are only ever inserted (the database trigger from migration 0005 refuses UPDATE,
DELETE and TRUNCATE), and every write in ``app.promotion`` records one in the same transaction as
the change it describes.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import AuditLog


def record_audit(
    session: Session, *, actor: str, action: str, target: str | None, details: dict[str, Any] | None = None
) -> AuditLog:
    """Insert one audit entry and flush (the caller's transaction commits it with the change).

    Args:
        actor: the token name (API) or ``cli:<os user>`` (CLI).
        action: dotted past tense, e.g. ``checkpoint.promoted``, ``token.revoked``.
        target: what was changed, e.g. ``checkpoint:<id>`` or ``token:<name>``.
        details: JSON-serialisable context (reason, previous production, gate decision id).
    """
    row = AuditLog(actor=actor, action=action, target=target, details=details or {})
    session.add(row)
    session.flush()
    return row


def list_audit(
    session: Session, *, limit: int, before_id: int | None = None, action: str | None = None
) -> list[AuditLog]:
    """Audit entries newest first (by id), ``limit`` of them, strictly older than ``before_id``."""
    stmt = select(AuditLog).order_by(AuditLog.id.desc()).limit(limit)
    if before_id is not None:
        stmt = stmt.where(AuditLog.id < before_id)
    if action:
        stmt = stmt.where(AuditLog.action == action)
    return list(session.scalars(stmt))

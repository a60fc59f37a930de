"""Registering checkpoints: a trained candidate, or a model folder registered by hand.

Invariants (in the caller's ONE transaction, flushed, never committed):

- a registered checkpoint has its row, its ``checkpoint_trajectory`` lineage rows (a trained one),
  a ``checkpoint.registered`` audit entry and a ``checkpoint.created`` lifecycle message;
- a candidate that trained on trajectories an erasure or a privacy purge deleted while it trained
  is registered flagged ``trained_on_erased`` (promotion refuses it) and the erasure requests name
  it; so is one whose parent is flagged (:func:`inherit_parent_flag`, which the caller takes last);
- a model registered by hand becomes ``production`` only when no production exists (with a
  ``promotion`` row of kind ``initial``, audited and announced like any promotion); otherwise it
  is a ``candidate``: promotions go through the gate.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.lifecycle.erasure import TRAINED_ON_ERASED, erasure_reasons, record_flag
from app.lifecycle.messages import CheckpointCreated, LineageEntry, ProductionChanged
from app.lifecycle.status import CheckpointStatus
from app.models import Checkpoint, Promotion
from app.outbox.lifecycle import enqueue_lifecycle
from app.repositories.audit import record_audit
from app.repositories.checkpoints import add_checkpoint, add_checkpoint_trajectories, get_production

log = logging.getLogger(__name__)

REGISTERED = "checkpoint.registered"
TRAINER = "trainer"


def register_candidate(
    session: Session,
    *,
    checkpoint_id: str,
    path: str,
    parent: Checkpoint,
    trajectories: Sequence[tuple[uuid.UUID, str, str | None]],
    manifest: dict[str, Any],
    metrics: dict[str, Any],
    reward_spec: str | None,
    cycle_id: uuid.UUID,
    actor: str = TRAINER,
) -> Checkpoint:
    """Insert a trained candidate (status ``candidate``), its lineage rows, its audit entry and its
    ``checkpoint.created`` message; flag it when its data was erased while it trained.

    Args:
        trajectories: ``(trajectory_id, user_id, task_id)`` of every trajectory it trained on.
        metrics: the summary metrics stored on the row.

    Raises:
        sqlalchemy.exc.IntegrityError: ``checkpoint_id`` exists already.
    """
    row = add_checkpoint(
        session,
        checkpoint_id=checkpoint_id,
        path=path,
        status=CheckpointStatus.CANDIDATE,
        parent_id=parent.id,
        generation=parent.generation + 1,
        manifest=manifest,
        metrics=metrics,
        reward_spec=reward_spec,
        num_trajectories=len(trajectories),
        stable=True,
    )
    add_checkpoint_trajectories(session, checkpoint_id, list(trajectories))
    gone, requests = _flag_if_deleted_since_selection(session, checkpoint_id, [t[0] for t in trajectories])
    if gone:
        row.trained_on_erased, row.erasure_flagged_at = True, datetime.now(UTC)
        reason = f"{TRAINED_ON_ERASED} (erasure requests {', '.join(requests) or 'none'}: deleted while it trained)"
        record_flag(session, row.id, actor=actor, reason=reason, cause=None, inherited_from=None)
        log.warning(
            "candidate %s trained on %d trajectories erased or made private while it trained (erasure "
            "requests %s): registered flagged trained_on_erased, so it cannot be promoted",
            checkpoint_id,
            len(gone),
            requests or "none",
        )
    message = CheckpointCreated(
        checkpoint_id=checkpoint_id,
        actor=actor,
        parent_id=parent.id,
        generation=parent.generation + 1,
        path=path,
        reward_spec=reward_spec,
        num_trajectories=len(trajectories),
        cycle_id=str(cycle_id),
    )
    details = {"path": path, "status": row.status, "parent_id": parent.id, "cycle_id": str(cycle_id)}
    record_audit(session, actor=actor, action=REGISTERED, target=f"checkpoint:{checkpoint_id}", details=details)
    enqueue_lifecycle(session, message)
    return row


def _flag_if_deleted_since_selection(
    session: Session, checkpoint_id: str, trajectory_ids: list[uuid.UUID]
) -> tuple[list[uuid.UUID], list[str]]:
    """The trajectories among ``trajectory_ids`` (all present when the cycle selected them) that an
    erasure or a privacy purge deleted while it trained, and the erasure requests that did. Those
    could not flag a checkpoint not yet registered, so registration does: the requests get it in
    their ``checkpoints_flagged`` here, the caller sets ``trained_on_erased``. The surviving rows are
    locked ``FOR KEY SHARE`` until the caller commits, so a deletion not committed yet waits for the
    lineage rows this transaction writes, and its own flagging then sees them.

    Returns:
        (deleted trajectory ids, erasure request ids), both sorted.
    """
    present = set(
        session.execute(
            text("SELECT id FROM trajectory WHERE id = ANY(CAST(:ids AS uuid[])) FOR KEY SHARE"),
            {"ids": trajectory_ids},
        ).scalars()
    )
    gone = sorted(set(trajectory_ids) - present)
    if not gone:
        return [], []
    requests = (
        session.execute(
            text(
                "UPDATE erasure_request SET checkpoints_flagged = array_append(checkpoints_flagged, :cid) "
                "WHERE trajectory_ids && CAST(:ids AS uuid[]) AND NOT (:cid = ANY(checkpoints_flagged)) "
                "RETURNING request_id"
            ),
            {"cid": checkpoint_id, "ids": gone},
        )
        .scalars()
        .all()
    )
    return gone, sorted(requests)


def inherit_parent_flag(session: Session, row: Checkpoint, *, actor: str = TRAINER) -> None:
    """Flag ``row`` when its parent is flagged ``trained_on_erased`` (a descendant of erased data is
    tainted too), with the audited reason, and name it in the erasure requests that name the
    parent. The parent is read ``FOR SHARE``: an erasure flagging it and not committed yet is
    waited for, and one that flags it later finds this child by its ``parent_id``. The caller
    takes this last in registration, so the wait holds no lock an erasure needs before its commit."""
    parent_id = row.parent_id
    if parent_id is None:
        return
    flagged = session.execute(
        text("SELECT trained_on_erased FROM checkpoint WHERE id = :id FOR SHARE"), {"id": parent_id}
    ).scalar()
    if not flagged:
        return
    session.execute(
        text(
            "UPDATE erasure_request SET checkpoints_flagged = array_append(checkpoints_flagged, :cid) "
            "WHERE :pid = ANY(checkpoints_flagged) AND NOT (:cid = ANY(checkpoints_flagged))"
        ),
        {"cid": row.id, "pid": parent_id},
    )
    if not row.trained_on_erased:
        row.trained_on_erased, row.erasure_flagged_at = True, datetime.now(UTC)
    why = erasure_reasons(session, [parent_id]).get(parent_id, TRAINED_ON_ERASED)
    reason = f"descends from {parent_id}, which is flagged: {why}"
    record_flag(session, row.id, actor=actor, reason=reason, cause=None, inherited_from=parent_id)
    log.warning("candidate %s registered flagged trained_on_erased: %s", row.id, reason)


def register_model(
    session: Session, *, checkpoint_id: str, path: str, manifest: dict[str, Any], production: bool, actor: str
) -> Checkpoint | None:
    """Register a model folder published by hand (``flywheel model init``, ``flywheel model
    register``): idempotent (an existing row is left as is; returns None); ``production=True`` makes
    it production only when none exists (the first production: a ``promotion`` of kind
    ``initial``), otherwise it is a ``candidate``."""
    if session.get(Checkpoint, checkpoint_id) is not None:
        return None
    production = production and get_production(session, for_update=True) is None
    status = CheckpointStatus.PRODUCTION if production else CheckpointStatus.CANDIDATE
    row = add_checkpoint(session, checkpoint_id=checkpoint_id, path=path, status=status, manifest=manifest, stable=True)
    details = {"path": path, "status": status.value}
    record_audit(session, actor=actor, action=REGISTERED, target=f"checkpoint:{checkpoint_id}", details=details)
    created = CheckpointCreated(checkpoint_id=checkpoint_id, actor=actor, parent_id=None, path=path, status=status)
    enqueue_lifecycle(session, created)
    if production:
        _first_production(session, row, actor=actor)
    return row


def _first_production(session: Session, row: Checkpoint, *, actor: str) -> None:
    """The promotion row, audit entry and message of the first production checkpoint."""
    row.promoted_at = datetime.now(UTC)
    promo = Promotion(
        id=uuid.uuid4(),
        kind="initial",
        checkpoint_id=row.id,
        previous_production_id=None,
        actor=actor,
        reason="first production checkpoint",
    )
    session.add(promo)
    session.flush()
    message = ProductionChanged(
        type="checkpoint.promoted",
        checkpoint_id=row.id,
        actor=actor,
        reason=promo.reason,
        promotion_id=str(promo.id),
        kind="initial",
        path=row.path,
        parent_id=None,
        lineage=[LineageEntry(id=row.id, path=row.path)],
    )
    audited = {"reason", "promotion_id", "previous_production_id", "gate_decision_id", "kind"}
    details = message.model_dump(mode="json", include=audited)
    record_audit(session, actor=actor, action="checkpoint.promoted", target=f"checkpoint:{row.id}", details=details)
    enqueue_lifecycle(session, message)

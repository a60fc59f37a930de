"""Database side of a training cycle: the single-flight lock, cycle rows, and candidate registration.

Invariants:
- At most one cycle runs at a time: ``cycle_lock`` holds a session-level
  ``pg_try_advisory_lock`` on its own connection for the whole cycle (released on exit, and by
  Postgres if the process dies).
- A candidate is registered all-or-nothing: the ``checkpoint`` row, its ``checkpoint_trajectory``
  lineage rows, the ``training_cycle`` update (status, watermark) and the ``checkpoint.created``
  outbox message are written in ONE transaction. Functions here flush, never commit.
- A candidate is never gated on a task it trained on: registration holds the eval hold-out lock and
  retires eval tasks mined (after its cycle selected its data) from what it trained on
  (``app.repositories.holdout``).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select, text, update
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock
from app.models import Checkpoint, TrainingCycle
from app.outbox.lifecycle import enqueue_lifecycle
from app.promotion.erasure import FLAG_ACTION, TRAINED_ON_ERASED, erasure_reasons
from app.repositories.audit import record_audit
from app.repositories.checkpoints import add_checkpoint, add_checkpoint_trajectories
from app.repositories.holdout import retire_trained_eval_tasks
from trainer.data import CycleData

log = logging.getLogger(__name__)


@contextlib.contextmanager
def cycle_lock(engine) -> Iterator[bool]:
    """Try to take the trainer's advisory lock; yields whether this process holds it.

    The lock lives on a dedicated connection (session-level lock), so the cycle's own
    transactions can commit freely while it is held.
    """
    with engine.connect() as conn:
        got = bool(conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": AdvisoryLock.CYCLE}).scalar())
        conn.commit()
        try:
            yield got
        finally:
            if got:
                conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": AdvisoryLock.CYCLE})
                conn.commit()


def fail_interrupted_cycles(session: Session) -> int:
    """Mark ``running`` cycles as failed (only called while holding the lock: they are dead)."""
    result = session.execute(
        update(TrainingCycle)
        .where(TrainingCycle.status == "running")
        .values(status="failed", finished_at=datetime.now(UTC), detail="interrupted: the process died before finishing")
    )
    return result.rowcount or 0


def succeeded_cycle_ids(session: Session, cycle_ids: list[str]) -> set[str]:
    """Which of ``cycle_ids`` (strings) belong to succeeded cycles."""
    ids = [uuid.UUID(c) for c in cycle_ids]
    if not ids:
        return set()
    return {
        str(i)
        for i in session.scalars(
            select(TrainingCycle.id).where(TrainingCycle.id.in_(ids), TrainingCycle.status == "succeeded")
        )
    }


def start_cycle(session: Session, cycle_id: uuid.UUID, parent_id: str) -> TrainingCycle:
    """Insert a ``running`` cycle row; flush."""
    row = TrainingCycle(
        id=cycle_id, status="running", parent_checkpoint_id=parent_id, num_trajectories=0, detail="", metrics={}
    )
    session.add(row)
    session.flush()
    return row


def finish_cycle(
    session: Session,
    cycle_id: uuid.UUID,
    *,
    status: str,
    detail: str,
    metrics: dict[str, Any] | None = None,
    parent_id: str | None = None,
) -> None:
    """Record a cycle that ended without a candidate (``skipped`` or ``failed``); flush."""
    row = session.get(TrainingCycle, cycle_id)
    if row is None:
        row = TrainingCycle(id=cycle_id, parent_checkpoint_id=parent_id, num_trajectories=0)
        session.add(row)
    row.status, row.detail, row.metrics = status, detail, metrics or {}
    row.finished_at = datetime.now(UTC)
    session.flush()


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


def _record_flag(session: Session, checkpoint_id: str, reason: str, inherited_from: str | None = None) -> None:
    """The audit entry that tells a release manager why a checkpoint is flagged ``trained_on_erased``."""
    details = {"reason": reason, "inherited_from": inherited_from}
    record_audit(session, actor="trainer", action=FLAG_ACTION, target=f"checkpoint:{checkpoint_id}", details=details)


def _inherit_parent_flag(session: Session, row: Checkpoint, parent_id: str) -> None:
    """Flag ``row`` when its parent is flagged ``trained_on_erased`` (a descendant of erased data is
    tainted too, ``app.promotion.erasure``), with the audited reason, and name it in the erasure
    requests that name the parent. The parent is read ``FOR SHARE``: an erasure flagging it and not
    committed yet is waited for, and one that flags it later finds this child by its ``parent_id``.
    Taken last in registration, so the wait holds no lock an erasure needs before its commit."""
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
    _record_flag(session, row.id, reason, inherited_from=parent_id)
    log.warning("candidate %s registered flagged trained_on_erased: %s", row.id, reason)


def register_candidate(
    session: Session,
    *,
    cycle_id: uuid.UUID,
    checkpoint_id: str,
    path: str,
    parent: Checkpoint,
    data: CycleData,
    manifest: dict[str, Any],
    metrics: dict[str, Any],
) -> Checkpoint:
    """Insert the candidate, its lineage, the cycle's success and ``checkpoint.created``; flush. A
    candidate that trained on trajectories an erasure or a privacy purge deleted meanwhile is
    registered flagged ``trained_on_erased`` (promotion refuses it), and the erasure requests name it;
    so is one whose parent is flagged (a descendant of erased data). Eval tasks mined meanwhile
    from what it trained on are retired (``app.repositories.holdout``; listed in the candidate's
    and the cycle's metrics as ``eval_tasks_retired``).

    The caller's transaction makes the writes atomic (see module docstring).
    """
    summary = {k: v for k, v in metrics.items() if k != "history"}
    row = add_checkpoint(
        session,
        checkpoint_id=checkpoint_id,
        path=path,
        status="candidate",
        parent_id=parent.id,
        generation=parent.generation + 1,
        manifest=manifest,
        metrics=summary,
        reward_spec=data.reward_spec,
        num_trajectories=len(data.used),
        stable=True,
    )
    add_checkpoint_trajectories(session, checkpoint_id, [(t.id, t.user_id, t.task_id) for t in data.used])
    gone, requests = _flag_if_deleted_since_selection(session, checkpoint_id, [t.id for t in data.used])
    if gone:
        row.trained_on_erased, row.erasure_flagged_at = True, datetime.now(UTC)
        _record_flag(
            session,
            row.id,
            f"trained on data of an erased user (erasure requests {', '.join(requests) or 'none'}: "
            "deleted while it trained)",
        )
        log.warning(
            "candidate %s trained on %d trajectories erased or made private while it trained (erasure "
            "requests %s): registered flagged trained_on_erased, so it cannot be promoted",
            checkpoint_id,
            len(gone),
            requests or "none",
        )
    retired = retire_trained_eval_tasks(session, checkpoint_id)
    if retired:
        summary = {**summary, "eval_tasks_retired": retired}
        row.metrics = summary  # a new dict: the JSON column does not track in-place changes
        log.warning(
            "candidate %s trained on %d eval tasks mined while it trained: retired from the eval suites (%s)",
            checkpoint_id,
            len(retired),
            ", ".join(retired[:10]),
        )
    _inherit_parent_flag(session, row, parent.id)
    cycle = session.get(TrainingCycle, cycle_id)
    cycle.status, cycle.checkpoint_id = "succeeded", checkpoint_id
    cycle.num_trajectories = len(data.used)
    cycle.watermark_finalized_at, cycle.watermark_trajectory_id = data.watermark or (None, None)
    cycle.watermark_seq = data.watermark_seq
    cycle.metrics = {
        "excluded": data.excluded_counts(),
        **{k: v for k, v in summary.items() if k != "data"},
        "data": summary.get("data", {}),
    }
    cycle.detail = f"candidate {checkpoint_id} from {parent.id} on {len(data.used)} trajectories"
    cycle.finished_at = datetime.now(UTC)
    enqueue_lifecycle(
        session,
        "checkpoint.created",
        checkpoint_id,
        parent_id=parent.id,
        generation=parent.generation + 1,
        path=path,
        reward_spec=data.reward_spec,
        num_trajectories=len(data.used),
        delta=manifest.get("delta", {}).get("file"),
        cycle_id=str(cycle_id),
    )
    session.flush()
    return row

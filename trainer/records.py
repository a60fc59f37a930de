"""Database side of a training cycle: the single-flight lock, cycle rows, and candidate registration.

Invariants:
- At most one cycle runs at a time: ``cycle_lock`` holds a session-level
  ``pg_try_advisory_lock`` on its own connection for the whole cycle (released on exit, and by
  Postgres if the process dies).
- A candidate is registered all-or-nothing: its registration (``app.lifecycle.registration``: the
  ``checkpoint`` row, its lineage rows, the audit entry, the ``checkpoint.created`` outbox message,
  the erasure flags) and the ``training_cycle`` update (status, watermark) are written in ONE
  transaction. Functions here flush, never commit.
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
from typing import Any, cast

from sqlalchemy import CursorResult, select, text, update
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock
from app.lifecycle.registration import inherit_parent_flag
from app.lifecycle.registration import register_candidate as register_checkpoint
from app.models import Checkpoint, TrainingCycle
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
    result = cast(  # an UPDATE's result is a CursorResult, which has rowcount
        CursorResult[Any],
        session.execute(
            update(TrainingCycle)
            .where(TrainingCycle.status == "running")
            .values(
                status="failed", finished_at=datetime.now(UTC), detail="interrupted: the process died before finishing"
            )
        ),
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
    row = register_checkpoint(
        session,
        checkpoint_id=checkpoint_id,
        path=path,
        parent=parent,
        trajectories=[(t.id, t.user_id, t.task_id) for t in data.used],
        manifest=manifest,
        metrics=summary,
        reward_spec=data.reward_spec,
        cycle_id=cycle_id,
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
    inherit_parent_flag(session, row)
    cycle = session.get_one(TrainingCycle, cycle_id)
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
    session.flush()
    return row

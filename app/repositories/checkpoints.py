"""Checkpoint registry queries (flush, never commit)."""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.core.errors import ConfigurationError, NotFoundError
from app.models import Checkpoint, CheckpointTrajectory
from app.models.checkpoints import CheckpointStatus


def get_checkpoint(session: Session, checkpoint_id: str) -> Checkpoint:
    """The checkpoint row.

    Raises:
        NotFoundError: no such checkpoint.
    """
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise NotFoundError(f"checkpoint {checkpoint_id!r} not found")
    return row


def get_production(session: Session, *, for_update: bool = False) -> Checkpoint | None:
    """The current production checkpoint (at most one, enforced by a partial unique index)."""
    stmt = select(Checkpoint).where(Checkpoint.status == CheckpointStatus.PRODUCTION)
    if for_update:
        stmt = stmt.with_for_update()
    return session.scalars(stmt).one_or_none()


def require_production(session: Session, hint: str = "run `flywheel model init` first") -> Checkpoint:
    """The current production checkpoint.

    Raises:
        ConfigurationError: there is none (``hint`` says what to do, after "no production checkpoint: ").
    """
    production = get_production(session)
    if production is None:
        raise ConfigurationError(f"no production checkpoint: {hint}")
    return production


def add_checkpoint(
    session: Session,
    *,
    checkpoint_id: str,
    path: str,
    status: CheckpointStatus = CheckpointStatus.CANDIDATE,
    parent_id: str | None = None,
    generation: int = 0,
    manifest: dict[str, Any] | None = None,
    metrics: dict[str, Any] | None = None,
    reward_spec: str | None = None,
    num_trajectories: int = 0,
    stable: bool = True,
) -> Checkpoint:
    """Insert a checkpoint row and flush."""
    row = Checkpoint(
        id=checkpoint_id,
        path=path,
        status=status.value,
        parent_id=parent_id,
        generation=generation,
        manifest=manifest or {},
        metrics=metrics or {},
        reward_spec=reward_spec,
        num_trajectories=num_trajectories,
        stable=stable,
    )
    session.add(row)
    session.flush()
    return row


def add_checkpoint_trajectories(session: Session, checkpoint_id: str, rows: list[tuple[Any, str, str | None]]) -> int:
    """Record which trajectories a checkpoint trained on: ``rows`` of ``(trajectory_id, user_id,
    task_id)``. Flushes; returns the number of rows added."""
    session.add_all(
        [
            CheckpointTrajectory(checkpoint_id=checkpoint_id, trajectory_id=tid, user_id=user, task_id=task)
            for tid, user, task in rows
        ]
    )
    session.flush()
    return len(rows)

"""Where the running loop stands, read from the database: what the demo and the bench watch while
``flywheel up`` turns the flywheel (they start nothing of the loop themselves).

Every function reads; none writes. A cycle is told apart by time: ``mark()`` before a batch of
traffic, then the sessions, training cycles and candidates after that mark.
"""

from __future__ import annotations

from dataclasses import dataclass
from datetime import datetime

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import Checkpoint, EventLog, PrivacyTombstone, TrainingCycle, Trajectory
from app.models.checkpoints import CheckpointStatus, GateVerdict
from app.repositories.checkpoints import get_production

# Checkpoint statuses after which nothing more happens to a candidate without a person.
SETTLED = (CheckpointStatus.PRODUCTION, CheckpointStatus.REJECTED, CheckpointStatus.RETIRED)


@dataclass(frozen=True)
class Mark:
    """A point of the loop's history: the newest event's ``seq`` and the database's clock."""

    seq: int
    at: datetime


@dataclass(frozen=True)
class CandidateState:
    """A cycle's candidate as the loop left it.

    ``decision`` is the gate's (``pass``, ``fail``, ``insufficient_evidence``; None before the gate
    decided); ``settled`` is true once the release policy has acted or nothing more will happen
    without a person (promoted, rejected, or held with a decision that is not a pass)."""

    checkpoint_id: str
    status: str
    decision: str | None
    settled: bool


def mark(session: Session) -> Mark:
    """The current point (see :class:`Mark`)."""
    seq = session.scalar(select(func.coalesce(func.max(EventLog.seq), 0)))
    return Mark(seq=int(seq or 0), at=session.execute(select(func.now())).scalar_one())


def sessions_since(session: Session, since: Mark) -> int:
    """Simulated sessions stored since ``since``: sessions started, and privacy-mode tombstones."""
    started = session.scalar(
        select(func.count(func.distinct(EventLog.session_id))).where(
            EventLog.type == "session.started", EventLog.seq > since.seq
        )
    )
    tombstones = session.scalar(
        select(func.count()).select_from(PrivacyTombstone).where(PrivacyTombstone.first_seen_at > since.at)
    )
    return int(started or 0) + int(tombstones or 0)


def trajectories_since(session: Session, since: Mark) -> tuple[int, int]:
    """``(stored, finalized)`` trajectories of sessions started since ``since``."""
    rows = session.execute(
        select(Trajectory.status, func.count()).where(Trajectory.started_at > since.at).group_by(Trajectory.status)
    ).all()
    counts = dict(rows)
    return sum(counts.values()), int(counts.get("finalized", 0))


def cycles_since(session: Session, since: Mark) -> list[TrainingCycle]:
    """Training cycles started after ``since`` that have finished (any outcome), oldest first."""
    return list(
        session.scalars(
            select(TrainingCycle)
            .where(TrainingCycle.started_at > since.at, TrainingCycle.status != "running")
            .order_by(TrainingCycle.started_at)
        )
    )


def candidate_state(session: Session, checkpoint_id: str) -> CandidateState:
    """The candidate's status and gate decision (see :class:`CandidateState`).

    Raises:
        LookupError: no such checkpoint.
    """
    row = session.get(Checkpoint, checkpoint_id)
    if row is None:
        raise LookupError(f"no checkpoint {checkpoint_id!r}")
    settled = row.status in SETTLED or (row.decision is not None and row.decision != GateVerdict.PASS)
    return CandidateState(checkpoint_id=row.id, status=row.status, decision=row.decision, settled=settled)


def production_id(session: Session) -> str | None:
    """The production checkpoint's id (None before the base model is registered)."""
    row = get_production(session)
    return row.id if row is not None else None


def base_id(session: Session) -> str | None:
    """The root of the lineage: the first checkpoint without a parent."""
    return session.scalar(
        select(Checkpoint.id).where(Checkpoint.parent_id.is_(None)).order_by(Checkpoint.created_at).limit(1)
    )

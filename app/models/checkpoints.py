"""Checkpoint registry and training cycles: the tables and the vocabulary of their columns.

A checkpoint's ``status`` says where it is in its life, ``decision`` what its latest gate found;
both columns are written only by ``app.lifecycle`` (which also holds the allowed transitions).
Exactly one checkpoint is ``production`` (a partial unique index enforces it); CHECK constraints
keep both columns inside their enums.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from enum import StrEnum
from typing import Any

from sqlalchemy import BigInteger, Boolean, CheckConstraint, DateTime, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column

#: The file a complete checkpoint directory carries (written last, so its presence means complete).
STABLE_MARKER = "STABLE"


class CheckpointStatus(StrEnum):
    """Where a checkpoint is in its life (transitions: ``app.lifecycle.status.TRANSITIONS``)."""

    CANDIDATE = "candidate"
    """Registered by the trainer (or by hand), not gated yet."""
    GATE_PASSED = "gate_passed"
    """The latest gate decided ``pass``."""
    GATE_FAILED = "gate_failed"
    """The latest gate did not pass: ``decision`` says whether it failed or lacked evidence."""
    PRODUCTION = "production"
    """Serves every user (exactly one)."""
    RETIRED = "retired"
    """Was production and was replaced (a rollback may bring it back)."""
    REJECTED = "rejected"
    """Taken out of the running for good."""


class GateVerdict(StrEnum):
    """What the latest gate found for a checkpoint (``evals.gate.models.GateResult.decision``), or that a
    release manager promoted over it."""

    PASS = "pass"
    """Every gated suite's interval cleared its margin."""
    FAIL = "fail"
    """A gated suite regressed: never promoted."""
    INSUFFICIENT_EVIDENCE = "insufficient_evidence"
    """Nothing failed, but some gated suite could not pass on the pairs it had."""
    NOT_GATED = "not_gated"
    """The gate had no suite to decide on."""
    OVERRIDDEN = "overridden"
    """Promoted over an ``insufficient_evidence`` or ``not_gated`` gate with a written, audited reason."""


CHECKPOINT_STATUSES = tuple(s.value for s in CheckpointStatus)
GATE_VERDICTS = tuple(v.value for v in GateVerdict)


def _in(column: str, values: tuple[str, ...]) -> str:
    return f"{column} IN ({', '.join(repr(v) for v in values)})"


class Checkpoint(Base):
    """A registered model checkpoint (a STABLE directory under the checkpoint store)."""

    __tablename__ = "checkpoint"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(String(128), ForeignKey("checkpoint.id"))
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="candidate")
    decision: Mapped[str | None] = mapped_column(
        String(32), comment="the latest gate's decision (GateVerdict), or overridden; NULL until gated"
    )
    path: Mapped[str] = mapped_column(Text, nullable=False, comment="directory of the checkpoint")
    stable: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    generation: Mapped[int] = mapped_column(Integer, nullable=False, default=0, comment="0 for a base model")
    reward_spec: Mapped[str | None] = mapped_column(String(128))
    manifest: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    metrics: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    num_trajectories: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    trained_on_erased: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    erasure_flagged_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = created_at_column()
    promoted_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (
        Index("uq_checkpoint_one_production", "status", unique=True, postgresql_where=text("status = 'production'")),
        Index("ix_checkpoint_status_created", "status", "created_at"),
        CheckConstraint(_in("status", CHECKPOINT_STATUSES), name="status_known"),
        CheckConstraint(f"decision IS NULL OR {_in('decision', GATE_VERDICTS)}", name="decision_known"),
    )


class CheckpointTrajectory(Base):
    """Which trajectories a checkpoint trained on (mirrors the manifest; kept after erasure)."""

    __tablename__ = "checkpoint_trajectory"

    checkpoint_id: Mapped[str] = mapped_column(
        String(128), ForeignKey("checkpoint.id", ondelete="CASCADE"), primary_key=True
    )
    trajectory_id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    user_id: Mapped[str] = mapped_column(String(128), nullable=False)
    task_id: Mapped[str | None] = mapped_column(String(256))

    __table_args__ = (
        Index("ix_checkpoint_trajectory_user_id", "user_id"),
        Index("ix_checkpoint_trajectory_trajectory_id", "trajectory_id"),
    )


class TrainingCycle(Base):
    """One run of the continual trainer (single-flight by advisory lock)."""

    __tablename__ = "training_cycle"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    status: Mapped[str] = mapped_column(
        String(16), nullable=False, default="running", comment="running | succeeded | failed | skipped"
    )
    parent_checkpoint_id: Mapped[str | None] = mapped_column(String(128))
    checkpoint_id: Mapped[str | None] = mapped_column(String(128))
    watermark_seq: Mapped[int | None] = mapped_column(BigInteger, comment="max event_log.seq of trajectories used")
    watermark_finalized_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True),
        comment="high-water mark of the trajectories used (newness is decided by checkpoint_trajectory)",
    )
    watermark_trajectory_id: Mapped[uuid.UUID | None] = mapped_column(
        UUID(as_uuid=True), comment="tie-breaker of the watermark among equal finalized_at"
    )
    num_trajectories: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    detail: Mapped[str] = mapped_column(Text, nullable=False, default="")
    metrics: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, comment="summary metrics, exclusion counts"
    )
    started_at: Mapped[datetime] = created_at_column()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_training_cycle_status_finished", "status", "finished_at"),)

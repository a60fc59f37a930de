"""Checkpoint registry and training cycles (owned by ``trainer/``; read by evals and the API).

Status lifecycle: ``candidate`` -> ``gate_passed`` | ``gate_failed`` -> ``production`` (via a
promotion) -> ``retired`` (replaced) ; ``rejected`` by a release manager. Exactly one checkpoint is
``production`` (a partial unique index enforces it).
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Boolean, DateTime, ForeignKey, Index, Integer, String, Text, text
from sqlalchemy.dialects.postgresql import JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column

CHECKPOINT_STATUSES = ("candidate", "gate_passed", "gate_failed", "production", "retired", "rejected")


class Checkpoint(Base):
    """A registered model checkpoint (a STABLE directory under the checkpoint store)."""

    __tablename__ = "checkpoint"

    id: Mapped[str] = mapped_column(String(128), primary_key=True)
    parent_id: Mapped[str | None] = mapped_column(String(128), ForeignKey("checkpoint.id"))
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="candidate")
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

"""Verified task environments, cached by content hash (owned by ``evals.environment_setup``)."""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import Boolean, ForeignKey, Index, String, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column


class TaskEnvironment(Base):
    """One environment proposed for a task (by the model or the fallback resolver) and its verdict.

    ``env_hash`` is sha256 of the task key and the canonical proposal
    (``evals.environments.environment_hash``), so a proposal is verified once per task content.
    A mined task's rows go with its ``eval_task`` row (an erasure deletes both).
    """

    __tablename__ = "task_environment"

    env_hash: Mapped[str] = mapped_column(String(64), primary_key=True)
    task_key: Mapped[str] = mapped_column(
        String(64), nullable=False, comment="sha256 of the task's code, tests, reference and the allowed list"
    )
    task_id: Mapped[str] = mapped_column(String(256), nullable=False)
    source: Mapped[str] = mapped_column(String(64), nullable=False)
    eval_task_id: Mapped[str | None] = mapped_column(
        String(256), ForeignKey("eval_task.task_id", ondelete="CASCADE"), comment="set for mined tasks"
    )
    origin: Mapped[str] = mapped_column(String(16), nullable=False, comment="model | fallback")
    proposal: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, comment="canonical {dependencies, files}")
    verified: Mapped[bool] = mapped_column(Boolean, nullable=False)
    reason: Mapped[str | None] = mapped_column(
        Text, comment="model rows: why verification failed; fallback rows: why the model's proposal was not used"
    )
    checkpoint_id: Mapped[str | None] = mapped_column(String(128), comment="the model that proposed")
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = created_at_column()

    __table_args__ = (
        Index("ix_task_environment_task_key_verified", "task_key", "verified"),
        Index("ix_task_environment_eval_task_id", "eval_task_id"),
    )

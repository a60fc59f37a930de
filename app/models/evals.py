"""Eval runs, their shards, per-task results, gate decisions and tasks held out of training (owned by
``evals/``)."""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    CheckConstraint,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    String,
    Text,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSON, JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column


class EvalRun(Base):
    """One suite run against one checkpoint; resumable (results are stored as tasks finish)."""

    __tablename__ = "eval_run"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    checkpoint_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    suite: Mapped[str] = mapped_column(String(128), nullable=False)
    suite_version: Mapped[str] = mapped_column(String(64), nullable=False)
    status: Mapped[str] = mapped_column(
        String(16), nullable=False, default="running", comment="running | succeeded | failed"
    )
    config: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    summary: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    started_at: Mapped[datetime] = created_at_column()
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))

    __table_args__ = (Index("ix_eval_run_checkpoint_suite", "checkpoint_id", "suite", "suite_version"),)


class EvalResult(Base):
    """The outcome of one sample of one task in an eval run."""

    __tablename__ = "eval_result"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    run_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("eval_run.id", ondelete="CASCADE"), nullable=False
    )
    task_id: Mapped[str] = mapped_column(String(256), nullable=False)
    sample_index: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    passed: Mapped[bool] = mapped_column(Boolean, nullable=False)
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=1, comment="test runs by the agent")
    turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    latency_s: Mapped[float] = mapped_column(Float, nullable=False, default=0.0)
    tool_calls: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    tool_call_errors: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    asked_question: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    edited: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    error: Mapped[str | None] = mapped_column(Text)
    detail: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = created_at_column()

    __table_args__ = (UniqueConstraint("run_id", "task_id", "sample_index"),)


class EvalShard(Base):
    """A slice of an eval run's tasks that one worker at a time claims and runs (``evals.shards``).

    Keyed by (run, shard index); the layout is fixed when the run is first sharded. ``attempts``
    counts claims and is the fencing token of the current one: only that claimant may heartbeat or
    finish the shard.
    """

    __tablename__ = "eval_shard"

    run_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("eval_run.id", ondelete="CASCADE"), primary_key=True
    )
    shard_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    # json, not jsonb: jsonb reorders object keys, and a task's hash (its plan identity) is taken
    # over its serialization in field order.
    tasks: Mapped[list[Any]] = mapped_column(
        JSON, nullable=False, default=list, comment="the shard's tasks, serialized (evals.tasks.model.Task)"
    )
    status: Mapped[str] = mapped_column(
        String(16), nullable=False, default="pending", comment="pending | running | done | failed"
    )
    attempts: Mapped[int] = mapped_column(Integer, nullable=False, default=0, comment="claims so far")
    worker: Mapped[str | None] = mapped_column(String(256), comment="the latest claimant")
    errors: Mapped[list[Any]] = mapped_column(
        JSONB, nullable=False, default=list, comment="sample errors and lost claims, oldest first"
    )
    dispatched_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    claimed_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    heartbeat_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finished_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    created_at: Mapped[datetime] = created_at_column()


class GateDecision(Base):
    """The gate's verdict on a candidate versus production, with every reason."""

    __tablename__ = "gate_decision"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    candidate_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    production_id: Mapped[str] = mapped_column(String(128), ForeignKey("checkpoint.id"), nullable=False)
    passed: Mapped[bool] = mapped_column(Boolean, nullable=False)
    decision: Mapped[str] = mapped_column(
        String(32), nullable=False, comment="pass | fail | insufficient_evidence | not_gated (evals.gate)"
    )
    reasons: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, default=list)
    report: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    report_path: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = created_at_column()

    __table_args__ = (
        Index("ix_gate_decision_candidate_created", "candidate_id", "created_at"),
        CheckConstraint("decision IN ('pass', 'fail', 'insufficient_evidence', 'not_gated')", name="decision_known"),
    )


class EvalTask(Base):
    """A task held out of training for good (mined from production, or a reserved session)."""

    __tablename__ = "eval_task"

    task_id: Mapped[str] = mapped_column(String(256), primary_key=True)
    suite: Mapped[str] = mapped_column(String(128), nullable=False)
    source_session_id: Mapped[str | None] = mapped_column(String(128))
    source_trajectory_id: Mapped[uuid.UUID | None] = mapped_column(UUID(as_uuid=True))
    content_hash: Mapped[str] = mapped_column(String(64), nullable=False, unique=True, comment="dedup key")
    spec: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict, comment="the task, serialized")
    created_at: Mapped[datetime] = created_at_column()

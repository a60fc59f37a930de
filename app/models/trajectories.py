"""Trajectory projection tables (owned by ``consumers/``; rebuilt from ``event_log`` by replay).

A trajectory is one session; it is made of segments (a ``context.summarized`` event starts a new
one). Token arrays are raw little-endian bytes (see ``producers.events.packing``): ``token_ids`` int32
``[T]``, ``loss_mask`` uint8 ``[T]`` (1 on the model's own completion tokens), ``behaviour_logprobs``
float32 ``[T]`` (0 where the mask is 0); ``turn_token_offsets[i]`` is where turn ``i``'s prompt piece
starts in them. MoE routes (``routed_experts``) hold, for each completion token in order, the expert
ids that routed it at serving (``routed_experts_shape`` = ``[layers, top_k]``), as little-endian
unsigned integers of ``routed_experts_itemsize`` bytes (1 while every id is below 256, else 2); they
cover every completion token of the segment or are empty (shape NULL).

Invariants (kept by ``consumers.projection``): every row is a pure function of ``event_log`` (replay
rebuilds them identically); ``status`` goes ``provisional`` -> ``finalized`` once, at ``finalized_at``
(an ingestion-clock instant: when the last expected signal was ingested, or ``window_closes_at``),
and a finalized trajectory and its ``reward_label`` rows never change afterwards except for
``late_event_ids`` (a relabel writes new label rows/values, from ``event_log``). Trainers read
``status = 'finalized' AND NOT reserved_for_eval`` joined to ``reward_label`` for their spec. Select
"finalized and not yet trained on" rather than by a watermark: ``finalized_at`` of a window
finalization is the close instant, up to a sweep interval before the row became visible, and with
several consumers a lower ``event_log.seq`` can commit after a higher one.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any

from sqlalchemy import (
    BigInteger,
    Boolean,
    DateTime,
    Float,
    ForeignKey,
    Index,
    Integer,
    LargeBinary,
    String,
    Text,
    UniqueConstraint,
    text,
)
from sqlalchemy.dialects.postgresql import ARRAY, JSONB, UUID
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column


class Trajectory(Base):
    """One agent session as RL data. ``status`` is ``provisional`` until finalized."""

    __tablename__ = "trajectory"

    id: Mapped[uuid.UUID] = mapped_column(UUID(as_uuid=True), primary_key=True)
    session_id: Mapped[str] = mapped_column(String(128), unique=True, nullable=False)
    user_id: Mapped[str] = mapped_column(String(128), nullable=False)
    org_id: Mapped[str] = mapped_column(String(128), nullable=False)
    task_id: Mapped[str | None] = mapped_column(String(256))
    task_source: Mapped[str | None] = mapped_column(String(64))
    checkpoint_id: Mapped[str | None] = mapped_column(String(128), comment="serving checkpoint at session start")
    status: Mapped[str] = mapped_column(String(16), nullable=False, default="provisional")
    request_text: Mapped[str | None] = mapped_column(Text)
    started_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    ended_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    last_event_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    finalized_at: Mapped[datetime | None] = mapped_column(DateTime(timezone=True))
    end_reason: Mapped[str | None] = mapped_column(String(64))
    num_segments: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    num_turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    ran_tests: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    test_commands: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False, default=list)
    expected_signals: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False, default=list)
    signals: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, comment="implicit signals seen so far, the reward inputs"
    )
    event_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)), nullable=False, default=list)
    max_event_seq: Mapped[int | None] = mapped_column(BigInteger, comment="highest event_log.seq folded in")
    reserved_for_eval: Mapped[bool] = mapped_column(Boolean, nullable=False, default=False)
    window_closes_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True),
        comment="ingestion-clock instant after which a provisional trajectory is finalized by the window",
    )
    finalized_by: Mapped[str | None] = mapped_column(String(16), comment="signals | window | abandoned")
    late_event_ids: Mapped[list[uuid.UUID]] = mapped_column(
        ARRAY(UUID(as_uuid=True)),
        nullable=False,
        default=list,
        comment="events that arrived after finalization (kept in event_log, ignored by this label)",
    )
    producer_seq_count: Mapped[int] = mapped_column(
        Integer,
        nullable=False,
        default=0,
        server_default=text("0"),
        comment="events folded in that carry the producer's per-session seq",
    )
    producer_seq_max: Mapped[int | None] = mapped_column(Integer, comment="highest producer seq folded in")
    incomplete_reason: Mapped[str | None] = mapped_column(
        Text, comment="why the finalized events are incomplete (never trained on); NULL: complete"
    )

    __table_args__ = (
        Index("ix_trajectory_status_finalized", "status", "finalized_at"),
        Index("ix_trajectory_provisional_window", "window_closes_at", postgresql_where=text("status = 'provisional'")),
        Index("ix_trajectory_user_id", "user_id"),
        Index("ix_trajectory_task_id", "task_id"),
    )


class TrajectorySegment(Base):
    """One context window of a trajectory: exact token ids, loss mask and behaviour log-probs."""

    __tablename__ = "trajectory_segment"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("trajectory.id", ondelete="CASCADE"), primary_key=True
    )
    segment_index: Mapped[int] = mapped_column(Integer, primary_key=True)
    checkpoint_id: Mapped[str | None] = mapped_column(String(128), comment="serving checkpoint of its turns")
    turn_checkpoint_ids: Mapped[list[str]] = mapped_column(
        ARRAY(Text), nullable=False, default=list, comment="serving checkpoint of each turn, in order"
    )
    turn_token_offsets: Mapped[list[int]] = mapped_column(
        ARRAY(Integer), nullable=False, default=list, comment="start of each turn's prompt piece in token_ids"
    )
    token_ids: Mapped[bytes] = mapped_column(LargeBinary, nullable=False, default=b"")
    loss_mask: Mapped[bytes] = mapped_column(LargeBinary, nullable=False, default=b"")
    behaviour_logprobs: Mapped[bytes] = mapped_column(LargeBinary, nullable=False, default=b"")
    num_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    num_completion_tokens: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    num_turns: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    tool_calls: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, default=list)
    tool_results: Mapped[list[Any]] = mapped_column(JSONB, nullable=False, default=list)
    event_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)), nullable=False, default=list)
    min_offset: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, default=dict, comment="{'topic:partition': first offset} lineage"
    )
    max_offset: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    routed_experts: Mapped[bytes] = mapped_column(
        LargeBinary,
        nullable=False,
        default=b"",
        server_default=text("''::bytea"),
        comment="MoE expert ids per completion token x layer x top-k (empty: no routes)",
    )
    routed_experts_shape: Mapped[list[int] | None] = mapped_column(
        ARRAY(Integer), comment="[layers, top_k] of routed_experts; NULL when it is empty"
    )
    routed_experts_itemsize: Mapped[int | None] = mapped_column(
        Integer, comment="bytes per expert id in routed_experts (1 or 2); NULL when it is empty"
    )


class RewardLabel(Base):
    """The reward of a finalized trajectory under one reward spec version, with its components."""

    __tablename__ = "reward_label"

    trajectory_id: Mapped[uuid.UUID] = mapped_column(
        UUID(as_uuid=True), ForeignKey("trajectory.id", ondelete="CASCADE"), primary_key=True
    )
    spec: Mapped[str] = mapped_column(String(128), primary_key=True, comment="name@version")
    reward: Mapped[float] = mapped_column(Float, nullable=False)
    components: Mapped[dict[str, Any]] = mapped_column(JSONB, nullable=False, default=dict)
    created_at: Mapped[datetime] = created_at_column()


class ErasureRequest(Base):
    """A processed right-to-erasure request and what it touched. Identified by (user, request id):
    one request id reused for another user is another request."""

    __tablename__ = "erasure_request"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    request_id: Mapped[str] = mapped_column(String(128), nullable=False)
    user_id: Mapped[str] = mapped_column(String(128), nullable=False)
    events_deleted: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    trajectories_deleted: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    trajectory_ids: Mapped[list[uuid.UUID]] = mapped_column(ARRAY(UUID(as_uuid=True)), nullable=False, default=list)
    checkpoints_flagged: Mapped[list[str]] = mapped_column(ARRAY(Text), nullable=False, default=list)
    dead_letters_deleted: Mapped[int] = mapped_column(Integer, nullable=False, default=0)
    eval_tasks_deleted: Mapped[int] = mapped_column(
        Integer, nullable=False, server_default=text("0"), comment="eval tasks mined from the erased sessions"
    )
    requested_at: Mapped[datetime | None] = mapped_column(
        DateTime(timezone=True), comment="occurred_at of the request; older events of the user are dropped"
    )
    created_at: Mapped[datetime] = created_at_column()

    __table_args__ = (UniqueConstraint("user_id", "request_id"),)

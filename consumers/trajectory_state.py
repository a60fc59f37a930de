"""Trajectory state as the projection (``consumers.projection``) folds it: a :class:`TrajectoryState`
per ``trajectory`` row and a :class:`SegmentState` per ``trajectory_segment`` row, a field per column
(:data:`TRAJECTORY_COLUMNS`, :data:`SEGMENT_COLUMNS`), and the session's deterministic trajectory id.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from consumers.rewards.math import RewardResult
from producers.events.types import EventBase

TRAJECTORY_NAMESPACE = uuid.UUID("6f1d3c1e-6b1a-4e35-9a51-7f0d2b8c9e11")


def trajectory_id_for(session_id: str) -> uuid.UUID:
    """The deterministic trajectory id of a session (``uuid5``)."""
    return uuid.uuid5(TRAJECTORY_NAMESPACE, session_id)


@dataclass
class SegmentState:
    """One ``trajectory_segment`` row; byte arrays grow as turns are folded in."""

    segment_index: int
    checkpoint_id: str | None = None
    turn_checkpoint_ids: list[str] = field(default_factory=list)
    turn_token_offsets: list[int] = field(default_factory=list)
    token_ids: bytearray = field(default_factory=bytearray)
    loss_mask: bytearray = field(default_factory=bytearray)
    behaviour_logprobs: bytearray = field(default_factory=bytearray)
    num_tokens: int = 0
    num_completion_tokens: int = 0
    num_turns: int = 0
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    tool_results: list[dict[str, Any]] = field(default_factory=list)
    event_ids: list[uuid.UUID] = field(default_factory=list)
    min_offset: dict[str, int] = field(default_factory=dict)
    max_offset: dict[str, int] = field(default_factory=dict)
    routed_experts: bytearray = field(default_factory=bytearray)
    routed_experts_shape: list[int] | None = None
    routed_experts_itemsize: int | None = None
    dirty: bool = False
    stored: bool = False
    """The row exists in ``trajectory_segment`` (loaded from it or written in this transaction)."""


@dataclass
class TrajectoryState:
    """One ``trajectory`` row plus the segments loaded for this fold and labels due."""

    id: uuid.UUID
    session_id: str
    user_id: str
    org_id: str
    task_id: str | None = None
    task_source: str | None = None
    checkpoint_id: str | None = None
    status: str = "provisional"
    request_text: str | None = None
    started_at: datetime | None = None
    ended_at: datetime | None = None
    last_event_at: datetime | None = None
    finalized_at: datetime | None = None
    end_reason: str | None = None
    num_segments: int = 0
    num_turns: int = 0
    completion_tokens: int = 0
    ran_tests: bool = False
    test_commands: list[str] = field(default_factory=list)
    expected_signals: list[str] = field(default_factory=list)
    signals: dict[str, Any] = field(default_factory=dict)
    event_ids: list[uuid.UUID] = field(default_factory=list)
    max_event_seq: int | None = None
    reserved_for_eval: bool = False
    window_closes_at: datetime | None = None
    finalized_by: str | None = None
    late_event_ids: list[uuid.UUID] = field(default_factory=list)
    producer_seq_count: int = 0
    producer_seq_max: int | None = None
    incomplete_reason: str | None = None
    # not columns:
    segments: dict[int, SegmentState] = field(default_factory=dict)
    dirty: bool = False
    stored: bool = False
    """The row exists in ``trajectory`` (loaded from it or written in this transaction)."""
    labels: list[RewardResult] = field(default_factory=list)
    """Labels computed by a finalization in this fold (to insert)."""


TRAJECTORY_COLUMNS = tuple(
    f for f in TrajectoryState.__dataclass_fields__ if f not in ("segments", "dirty", "stored", "labels")
)
SEGMENT_COLUMNS = tuple(f for f in SegmentState.__dataclass_fields__ if f not in ("dirty", "stored"))


def incomplete_reason(t: TrajectoryState) -> str | None:
    """Why the events folded into ``t`` are not the whole session, or None: no ``session.started``,
    or producer ``seq`` values missing below the highest seen (events without ``seq`` are judged by
    the start alone)."""
    why = []
    if t.started_at is None:
        why.append("no session.started")
    if t.producer_seq_max is not None and t.producer_seq_count <= t.producer_seq_max:
        missing = t.producer_seq_max + 1 - t.producer_seq_count
        why.append(f"{missing} of producer seq 0..{t.producer_seq_max} missing")
    return "; ".join(why) or None


def new_trajectory(event: EventBase) -> TrajectoryState:
    """An empty trajectory for the session of ``event``."""
    return TrajectoryState(
        id=trajectory_id_for(event.session_id),
        session_id=event.session_id,
        user_id=event.user_id,
        org_id=event.org_id,
        signals=empty_signals(),
    )


def empty_signals() -> dict[str, Any]:
    """The reward inputs of a session with no signal yet."""
    return {
        "edits": {},
        "followups": 0,
        "dissatisfied_followups": 0,
        "latency_s": 0.0,
        "tool_calls": 0,
        "invalid_tool_calls": 0,
        "tool_errors": 0,
        "test_runs": 0,
        "last_test_passed": None,
        "summaries": 0,
        "received_after_end": {},
    }

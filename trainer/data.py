"""What a training cycle learns from: trajectories, their token segments, and the outcome of selection.

:class:`CycleData` is what :func:`trainer.selection.select_cycle_data` returns (its rules and exclusion
reasons are documented there): the used trajectories as :class:`TrajectoryData` (reward, task group,
:class:`Segment` token arrays, lineage), the excluded ones with their reason, and the high-water marks
the checkpoint manifest records. Invariant: a trajectory id is in ``used`` or in ``excluded``, never
both (``defer`` moves it from one to the other), and ``watermark`` is the largest
``(finalized_at, id)`` in ``used`` (None while it is empty).
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import numpy as np


@dataclass
class Segment:
    """One context window of a trajectory, truncated to ``max_seq_len``.

    Attributes:
        token_ids: ``[T]`` int32. loss_mask: ``[T]`` uint8, 1 on tokens the model sampled.
        behaviour_logprobs: ``[T]`` float32, log mu of each sampled token (0 elsewhere), nats.
    """

    token_ids: np.ndarray
    loss_mask: np.ndarray
    behaviour_logprobs: np.ndarray
    routed_experts: np.ndarray | None = None
    """MoE only: ``[T, layers, top_k]`` int32, row ``t`` the serving experts at the position whose
    output sampled token ``t`` (position ``t - 1``); -1 on tokens the model did not sample. None
    when the segment has no routes."""


@dataclass
class TrajectoryData:
    """A trajectory the cycle trains on: its reward is shared by all its segments' tokens."""

    id: uuid.UUID
    session_id: str
    user_id: str
    task_id: str | None
    reward: float
    group: str
    finalized_at: datetime
    segments: list[Segment]
    event_ids: list[str]
    offsets: dict[str, list[int]]
    max_event_seq: int | None
    serving_checkpoints: list[str]
    truncated_tokens: int = 0

    @property
    def completion_tokens(self) -> int:
        """Trainable (model-sampled) tokens after truncation."""
        return int(sum(int(s.loss_mask[1:].sum()) for s in self.segments))

    def manifest_entry(self) -> dict[str, Any]:
        """Lineage of this trajectory for the checkpoint manifest."""
        return {
            "id": str(self.id),
            "session_id": self.session_id,
            "user_id": self.user_id,
            "task_id": self.task_id,
            "reward": self.reward,
            "finalized_at": self.finalized_at.isoformat(),
            "event_ids": self.event_ids,
            "offsets": self.offsets,
            "max_event_seq": self.max_event_seq,
            "serving_checkpoints": self.serving_checkpoints,
            "segments": len(self.segments),
            "completion_tokens": self.completion_tokens,
            "truncated_tokens": self.truncated_tokens,
        }


@dataclass
class CycleData:
    """The outcome of selection: used trajectories, exclusions with reasons, high-water marks."""

    reward_spec: str
    parent_id: str
    parent_generation: int
    window_start: datetime | None
    window_end: datetime
    used: list[TrajectoryData] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)
    older_than_window: int = 0
    watermark: tuple[datetime, uuid.UUID] | None = None
    previous_watermark: tuple[datetime, uuid.UUID] | None = None

    @property
    def watermark_seq(self) -> int | None:
        """Highest ``event_log.seq`` folded into a used trajectory."""
        seqs = [t.max_event_seq for t in self.used if t.max_event_seq is not None]
        return max(seqs) if seqs else None

    def defer(self, ids: set[uuid.UUID]) -> None:
        """Move used trajectories back to new (reason ``deferred``): the cycle will not train on
        or claim them; the watermark follows what stays used."""
        self.exclude(ids, "deferred")

    def exclude(self, ids: set[uuid.UUID], reason: str) -> None:
        """Move used trajectories to ``excluded`` with ``reason``. They stay new (unclaimed) for the
        next cycle; the watermark follows what stays used."""
        self.used = [t for t in self.used if t.id not in ids]
        for i in ids:
            self.excluded[str(i)] = reason
        self.watermark = max(((t.finalized_at, t.id) for t in self.used), default=None)

    def exclude_low_contrast(self, min_range: float) -> int:
        """Exclude every task group of two or more used trajectories whose rewards span less than
        ``min_range`` (``max - min``, reward units; reason ``low_reward_contrast``); return how many
        trajectories that excluded. Groups of one are kept (their baseline is
        ``singleton_baseline``'s). With ``min_range`` 0 nothing is excluded.

        A group whose sessions all ended the same way has advantages that are only its reward's
        secondary terms (under ``implicit@4``: follow-ups, latency, length; docs/trainer.md). The
        excluded trajectories stay new: a later session of the same task can give their group the
        contrast it lacks, within the staleness bounds. The filter is DAPO's dynamic sampling
        (Yu et al. 2025, arXiv 2503.14476, section 3.2: keep groups with ``0 < #correct < G``) for a
        continuous reward.
        """
        if min_range <= 0:
            return 0
        rewards: dict[str, list[float]] = {}
        for t in self.used:
            rewards.setdefault(t.group, []).append(t.reward)
        flat = {g for g, r in rewards.items() if len(r) > 1 and max(r) - min(r) < min_range}
        ids = {t.id for t in self.used if t.group in flat}
        self.exclude(ids, "low_reward_contrast")
        return len(ids)

    def excluded_counts(self) -> dict[str, int]:
        """Number of excluded trajectories per reason."""
        counts: dict[str, int] = {}
        for reason in self.excluded.values():
            counts[reason] = counts.get(reason, 0) + 1
        return dict(sorted(counts.items()))

    def manifest_section(self) -> dict[str, Any]:
        """The data part of the checkpoint manifest."""
        wm = self.watermark
        return {
            "reward_spec": self.reward_spec,
            "data_window": {
                "finalized_after": self.window_start.isoformat() if self.window_start else None,
                "selected_at": self.window_end.isoformat(),
                "previous_watermark": _wm_json(self.previous_watermark),
            },
            "watermark": {**(_wm_json(wm) or {}), "event_seq": self.watermark_seq},
            "trajectories": [t.manifest_entry() for t in self.used],
            "excluded": self.excluded,
            "excluded_counts": self.excluded_counts(),
            "older_than_window": self.older_than_window,
        }


def _wm_json(wm: tuple[datetime, uuid.UUID] | None) -> dict[str, str] | None:
    return None if wm is None else {"finalized_at": wm[0].isoformat(), "trajectory_id": str(wm[1])}

"""Which trajectories a training cycle learns from, and why the others are left out.

Invariant: every finalized trajectory of the last ``max_age_hours`` is either *used* (trained on,
listed in the manifest with its events and offsets) or *excluded* with a stated reason; none is
silently dropped, and none is trained twice. Older finalized trajectories are only counted.

"New" is decided by lineage, not by a timestamp: a trajectory is new until a registered checkpoint
lists it in ``checkpoint_trajectory`` (written in the same transaction that marks its cycle
succeeded). ``finalized_at`` is not a commit-order watermark -- a trajectory closed by its signal
window is stamped with the window's close, possibly minutes before the sweep that commits it -- so
a timestamp watermark could skip it forever. The cycle still records the ``(finalized_at, id)`` and
``event_log.seq`` high-water marks of what it used, for operators. Used trajectories are taken
oldest first in ``(finalized_at, id)`` order, up to ``max_trajectories``.

Exclusion reasons, checked in this order (the first that applies is recorded):

==========================  =====================================================================
``earlier_cycle``           a registered checkpoint already trained on it
``incomplete``              its events are not the whole session (no ``session.started``, or a gap
                            in the producer's ``seq``): ``trajectory.incomplete_reason`` says which
``reserved_for_eval``       the session is held out for evals
``eval_task``               its task is in ``eval_task`` (held-out tasks are never trained on)
``erased``                  its user asked for erasure after the session started
``no_reward``               no ``reward_label`` for the configured spec (yet)
``bad_reward``              the reward is not a finite number
``stale_hours``             its last event is older than ``max_age_hours``
``unknown_checkpoint``      a serving checkpoint of its turns is not registered
``stale_generations``       served by a checkpoint more than ``max_staleness_generations`` older
``no_segments``             no token data
``malformed_segment``       token ids, loss mask and behaviour log-probs disagree in length, or
                            its routed experts do not cover its completion tokens
``no_completion_tokens``    nothing the model generated is left to train on
``deferred``                over ``max_trajectories`` or the cycle's step budget (``max_steps``);
                            stays new for the next cycle
``low_reward_contrast``     after selection, its task group's rewards span less than
                            ``min_group_reward_range`` (:meth:`CycleData.exclude_low_contrast`);
                            stays new for the next cycle
==========================  =====================================================================
"""

from __future__ import annotations

import math
import uuid
from datetime import datetime, timedelta
from typing import Literal

import numpy as np
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.models import (
    Checkpoint,
    CheckpointTrajectory,
    ErasureRequest,
    EvalTask,
    RewardLabel,
    TrainingCycle,
    Trajectory,
    TrajectorySegment,
)
from app.repositories.trajectories import ROUTE_DTYPES, unpack_routes
from producers.events.packing import unpack_floats, unpack_ints
from trainer.config import DataConfig
from trainer.data import CycleData, Segment, TrajectoryData


def last_watermark(session: Session) -> tuple[datetime, uuid.UUID] | None:
    """``(finalized_at, trajectory_id)`` high-water mark of the last succeeded cycle, or None
    (reported in the manifest; selection itself goes by lineage, see the module docstring)."""
    row = session.execute(
        select(TrainingCycle.watermark_finalized_at, TrainingCycle.watermark_trajectory_id)
        .where(TrainingCycle.status == "succeeded", TrainingCycle.watermark_finalized_at.is_not(None))
        .order_by(TrainingCycle.watermark_finalized_at.desc(), TrainingCycle.finished_at.desc())
        .limit(1)
    ).first()
    if row is None or row[0] is None:
        return None
    return row[0], row[1] or uuid.UUID(int=0)


def trajectories_waiting(session: Session) -> tuple[int, datetime | None]:
    """``(count, newest activity)`` of the finalized trajectories no checkpoint trained on,
    finalized since the last training cycle that finished (succeeded or skipped) started: what the
    ``train-when-ready`` schedule weighs against ``FLYWHEEL_TRAIN_READY_TRAJECTORIES``. Trajectories
    a finished cycle left out for a reason are not counted again, so they never start a cycle on
    their own; the interval schedule still runs. A cycle that failed or never finished (its worker
    was killed: the row says ``running`` until the next cycle marks it ``failed``) decided nothing,
    so what it would have trained on still counts and starts the next cycle.

    The newest activity is the latest of their ``finalized_at`` and the newest event
    (``last_event_at``) of a trajectory still open since that cycle: a batch of traffic is quiet only
    when no session of it is still talking, not merely when none finished lately (sessions of a
    batch served on a loaded CPU finish in waves minutes apart).
    """
    last_start = session.scalar(
        select(func.max(TrainingCycle.started_at)).where(TrainingCycle.status.in_(("succeeded", "skipped")))
    )
    trained = select(CheckpointTrajectory.trajectory_id).where(CheckpointTrajectory.trajectory_id == Trajectory.id)
    query = select(func.count(), func.max(Trajectory.finalized_at)).where(
        Trajectory.status == "finalized", ~trained.exists()
    )
    still_open = select(func.max(Trajectory.last_event_at)).where(Trajectory.status == "provisional")
    if last_start is not None:
        query = query.where(Trajectory.finalized_at > last_start)
        still_open = still_open.where(Trajectory.last_event_at > last_start)
    count, newest = session.execute(query).one()
    talking = session.scalar(still_open)
    return int(count or 0), max((t for t in (newest, talking) if t is not None), default=None)


def select_cycle_data(
    session: Session, config: DataConfig, parent: Checkpoint, *, now: datetime | None = None
) -> CycleData:
    """Select and load the trajectories of one cycle (see the module docstring for the rules).

    Args:
        session: an open session (read only).
        config: the data section of the trainer config.
        parent: the checkpoint being trained (its generation bounds staleness).
        now: the cycle's clock (default: the database's ``now()``).

    Returns:
        :class:`CycleData`; ``used`` ordered by ``(finalized_at, id)``.
    """
    now = now or session.execute(select(func.now())).scalar_one()
    age_floor = now - timedelta(hours=config.max_age_hours)
    previous = last_watermark(session)
    data = CycleData(
        reward_spec=config.reward_spec,
        parent_id=parent.id,
        parent_generation=parent.generation,
        window_start=age_floor,
        window_end=now,
        previous_watermark=previous,
    )
    data.older_than_window = (
        session.scalar(
            select(func.count())
            .select_from(Trajectory)
            .where(Trajectory.status == "finalized", Trajectory.finalized_at <= age_floor)
        )
        or 0
    )
    trained = (
        select(CheckpointTrajectory.trajectory_id).where(CheckpointTrajectory.trajectory_id == Trajectory.id).exists()
    )
    query = (
        select(Trajectory, RewardLabel.reward, trained.label("trained"))
        .outerjoin(RewardLabel, (RewardLabel.trajectory_id == Trajectory.id) & (RewardLabel.spec == config.reward_spec))
        .where(Trajectory.status == "finalized", Trajectory.finalized_at > age_floor)
        .order_by(Trajectory.finalized_at, Trajectory.id)
    )
    if config.same_data_as is not None:  # a replica of that checkpoint's data: claimed already, by design
        same = select(CheckpointTrajectory.trajectory_id).where(
            CheckpointTrajectory.checkpoint_id == config.same_data_as
        )
        query = query.where(Trajectory.id.in_(same))
    considered = []
    for traj, reward, already in session.execute(query).all():
        if already and config.same_data_as is None:
            data.excluded[str(traj.id)] = "earlier_cycle"
        else:
            considered.append((traj, reward))
    if not considered:
        return data

    eval_tasks = _eval_task_ids(session, {t.task_id for t, _ in considered if t.task_id})
    erased = _erasures(session, {t.user_id for t, _ in considered})
    segments = _segments(session, [t.id for t, _ in considered])
    generations = _generations(session, considered, segments)
    for traj, reward in considered:
        if len(data.used) >= config.max_trajectories:
            data.excluded[str(traj.id)] = "deferred"
            continue
        reason, item = _classify(
            traj,
            reward,
            segments.get(traj.id, []),
            config,
            data.parent_generation,
            eval_tasks,
            erased,
            generations,
            age_floor,
        )
        if reason is not None:
            data.excluded[str(traj.id)] = reason
        else:
            assert item is not None and traj.finalized_at is not None  # a used trajectory, finalized
            data.used.append(item)
            data.watermark = (traj.finalized_at, traj.id)
    return data


def _eval_task_ids(session: Session, task_ids: set[str]) -> set[str]:
    if not task_ids:
        return set()
    return set(session.scalars(select(EvalTask.task_id).where(EvalTask.task_id.in_(task_ids))))


def _erasures(session: Session, user_ids: set[str]) -> dict[str, datetime]:
    rows = session.execute(
        select(ErasureRequest.user_id, func.max(ErasureRequest.created_at))
        .where(ErasureRequest.user_id.in_(user_ids))
        .group_by(ErasureRequest.user_id)
    )
    return {u: at for u, at in rows}


def _segments(session: Session, ids: list[uuid.UUID]) -> dict[uuid.UUID, list[TrajectorySegment]]:
    out: dict[uuid.UUID, list[TrajectorySegment]] = {}
    for seg in session.scalars(
        select(TrajectorySegment)
        .where(TrajectorySegment.trajectory_id.in_(ids))
        .order_by(TrajectorySegment.trajectory_id, TrajectorySegment.segment_index)
    ):
        out.setdefault(seg.trajectory_id, []).append(seg)
    return out


def _serving_checkpoints(traj: Trajectory, segs: list[TrajectorySegment]) -> list[str]:
    """Every checkpoint that served a turn of the trajectory (turn-level when recorded)."""
    ids: list[str] = []
    for seg in segs:
        ids.extend(getattr(seg, "turn_checkpoint_ids", None) or [])
        if seg.checkpoint_id:
            ids.append(seg.checkpoint_id)
    if not ids and traj.checkpoint_id:
        ids.append(traj.checkpoint_id)
    return sorted(set(ids))


def _generations(session: Session, considered, segments) -> dict[str, int]:
    ids = {c for traj, _ in considered for c in _serving_checkpoints(traj, segments.get(traj.id, []))}
    if not ids:
        return {}
    return dict(session.execute(select(Checkpoint.id, Checkpoint.generation).where(Checkpoint.id.in_(ids))).all())


def _classify(
    traj: Trajectory,
    reward: float | None,
    segs: list[TrajectorySegment],
    config: DataConfig,
    parent_generation: int,
    eval_tasks: set[str],
    erased: dict[str, datetime],
    generations: dict[str, int],
    age_floor: datetime,
) -> tuple[str | None, TrajectoryData | None]:
    """The exclusion reason of a trajectory, or ``(None, its loaded data)``."""
    assert traj.finalized_at is not None  # selected among finalized trajectories
    if traj.incomplete_reason is not None:
        return "incomplete", None
    if traj.reserved_for_eval:
        return "reserved_for_eval", None
    if traj.task_id and traj.task_id in eval_tasks:
        return "eval_task", None
    erased_at = erased.get(traj.user_id)
    if erased_at is not None and (traj.started_at is None or traj.started_at <= erased_at):
        return "erased", None
    if reward is None:
        return "no_reward", None
    if not math.isfinite(reward):
        return "bad_reward", None
    last_seen = traj.last_event_at or traj.ended_at or traj.finalized_at
    if last_seen < age_floor:
        return "stale_hours", None
    served_by = _serving_checkpoints(traj, segs)
    if any(c not in generations for c in served_by):
        return "unknown_checkpoint", None
    if served_by and parent_generation - min(generations[c] for c in served_by) > config.max_staleness_generations:
        return "stale_generations", None
    if not segs:
        return "no_segments", None
    segments, truncated = [], 0
    event_ids: list[str] = []
    offsets: dict[str, list[int]] = {}
    for seg in segs:
        ids, mask, lp = unpack_ints(seg.token_ids), unpack_ints_u8(seg.loss_mask), unpack_floats(seg.behaviour_logprobs)
        if not (len(ids) == len(mask) == len(lp)) or not np.isfinite(lp[mask.astype(bool)]).all():
            return "malformed_segment", None
        routes = _token_routes(seg, mask)
        if routes is False:
            return "malformed_segment", None
        truncated += max(0, len(ids) - config.max_seq_len)
        n = config.max_seq_len
        segments.append(Segment(ids[:n], mask[:n], lp[:n], None if routes is None else routes[:n]))
        event_ids.extend(str(e) for e in seg.event_ids)
        for tp, first in (seg.min_offset or {}).items():
            last = (seg.max_offset or {}).get(tp, first)
            lo, hi = offsets.get(tp, [first, last])
            offsets[tp] = [min(lo, first), max(hi, last)]
    item = TrajectoryData(
        id=traj.id,
        session_id=traj.session_id,
        user_id=traj.user_id,
        task_id=traj.task_id,
        reward=float(reward),
        group=traj.task_id or f"session:{traj.session_id}",
        finalized_at=traj.finalized_at,
        segments=segments,
        event_ids=event_ids or [str(e) for e in traj.event_ids],
        offsets=offsets,
        max_event_seq=traj.max_event_seq,
        serving_checkpoints=served_by,
        truncated_tokens=truncated,
    )
    if item.completion_tokens == 0:
        return "no_completion_tokens", None
    return None, item


def _token_routes(seg: TrajectorySegment, mask: np.ndarray) -> np.ndarray | Literal[False] | None:
    """The segment's stored routes spread over its tokens (``Segment.routed_experts``), None when it
    has none, False when they do not cover exactly its completion tokens."""
    shape = getattr(seg, "routed_experts_shape", None)
    if not shape:
        return None
    raw, size = seg.routed_experts or b"", seg.routed_experts_itemsize
    if len(shape) != 2 or size not in ROUTE_DTYPES or len(raw) % size:
        return False
    flat = unpack_routes(raw, size)
    layers, k = shape
    where = np.flatnonzero(mask)
    if flat.size != len(where) * layers * k:
        return False
    out = np.full((len(mask), layers, k), -1, dtype=np.int32)
    out[where] = flat.reshape(len(where), layers, k)
    return out


def unpack_ints_u8(raw: bytes | memoryview | None) -> np.ndarray:
    """Raw loss-mask bytes -> ``uint8`` array ``[T]``."""
    if not raw:
        return np.zeros(0, dtype=np.uint8)
    return np.frombuffer(bytes(raw), dtype=np.uint8).copy()

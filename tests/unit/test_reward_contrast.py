"""``CycleData.exclude_low_contrast``: which task groups a cycle leaves out for lack of reward contrast."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

from trainer.data import CycleData, TrajectoryData

T0 = datetime(2026, 1, 1, tzinfo=UTC)


def _traj(group: str, reward: float, minute: int) -> TrajectoryData:
    return TrajectoryData(
        id=uuid.uuid4(),
        session_id=f"s{minute}",
        user_id="u",
        task_id=group,
        reward=reward,
        group=group,
        finalized_at=T0 + timedelta(minutes=minute),
        segments=[],
        event_ids=[],
        offsets={},
        max_event_seq=None,
        serving_checkpoints=["base"],
    )


def _data(*trajs: TrajectoryData) -> CycleData:
    data = CycleData(reward_spec="implicit@4", parent_id="base", parent_generation=0, window_start=None, window_end=T0)
    data.used = list(trajs)
    data.watermark = max((t.finalized_at, t.id) for t in trajs)
    return data


def test_groups_below_the_range_are_excluded_with_their_reason():
    works = [_traj("a", 0.7, 0), _traj("a", -1.2, 1)]  # range 1.9
    flat = [_traj("b", -1.1, 2), _traj("b", -1.3, 3), _traj("b", -1.0, 4)]  # range 0.3
    alone = _traj("c", -1.2, 5)  # a group of one: its baseline is singleton_baseline's
    data = _data(*works, *flat, alone)

    assert data.exclude_low_contrast(0.5) == 3
    assert [t.id for t in data.used] == [t.id for t in [*works, alone]]
    assert data.excluded == {str(t.id): "low_reward_contrast" for t in flat}
    assert data.watermark == (alone.finalized_at, alone.id)


def test_the_range_is_strict_and_zero_keeps_every_group():
    pair = [_traj("a", -1.0, 0), _traj("a", -0.5, 1)]  # range exactly 0.5
    data = _data(*pair)
    assert data.exclude_low_contrast(0.0) == 0 and data.exclude_low_contrast(0.5) == 0
    assert data.exclude_low_contrast(0.51) == 2 and data.used == [] and data.watermark is None

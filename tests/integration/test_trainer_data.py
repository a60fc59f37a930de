"""Data selection against a real Postgres: every finalized trajectory in the window is used or
excluded with its reason (staleness in generations and hours, eval tasks and reserved sessions,
missing rewards, erasure), the watermark advances, and the per-cycle cap defers the rest."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from app.models.checkpoints import CheckpointStatus
from trainer.config import DataConfig
from trainer.selection import select_cycle_data
from trainer.testing import insert_trajectory, make_segment

pytestmark = pytest.mark.integration

SEG = make_segment([1, 5, 6], [7, 8, 9], [0, 0, 0, -1.0, -2.0, -0.5])


@pytest.fixture
def lineage(session):
    """base (gen 0) -> c1 (gen 1) -> c2 (gen 2) -> c3 (gen 3, production)."""
    from app.repositories.checkpoints import add_checkpoint

    parent = None
    for gen, cid in enumerate(["base", "c1", "c2", "c3"]):
        add_checkpoint(
            session,
            checkpoint_id=cid,
            path=f"/nowhere/{cid}",
            parent_id=parent,
            generation=gen,
            status=CheckpointStatus.PRODUCTION if cid == "c3" else CheckpointStatus.RETIRED,
        )
        parent = cid
    session.commit()
    from app.models import Checkpoint

    return session.get(Checkpoint, "c3")


def test_every_trajectory_used_or_excluded_with_reason(session, lineage):
    from app.models import ErasureRequest, EvalTask

    now = datetime.now(UTC)
    ids = {
        "ok": insert_trajectory(session, segments=[SEG, SEG], reward=1.0, checkpoint_id="c2", task_id="t1"),
        "ok_c1": insert_trajectory(session, segments=[SEG], reward=0.0, checkpoint_id="c1", task_id="t1"),
        "reserved": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", reserved_for_eval=True),
        "eval_task": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", task_id="held-out"),
        "no_reward": insert_trajectory(session, segments=[SEG], reward=None, checkpoint_id="c3"),
        "stale_gen": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="base"),
        "unknown": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="ghost"),
        "stale_hours": insert_trajectory(
            session,
            segments=[SEG],
            reward=1.0,
            checkpoint_id="c3",
            finalized_at=now - timedelta(hours=1),
            last_event_at=now - timedelta(hours=30),
        ),
        "erased": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", user_id="gone"),
        "no_tokens": insert_trajectory(session, segments=[make_segment([1, 2, 3], [])], reward=1.0, checkpoint_id="c3"),
        "no_segments": insert_trajectory(session, segments=[], reward=1.0, checkpoint_id="c3"),
        "wrong_spec": insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", spec="other@2"),
    }
    provisional = insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", status="provisional")
    ancient = insert_trajectory(
        session, segments=[SEG], reward=1.0, checkpoint_id="c3", finalized_at=now - timedelta(hours=100)
    )
    session.add(EvalTask(task_id="held-out", suite="mined", content_hash="h1", spec={}))
    session.add(ErasureRequest(request_id="r1", user_id="gone", trajectory_ids=[], checkpoints_flagged=[]))
    session.commit()

    cfg = DataConfig(max_staleness_generations=2, max_age_hours=24)
    data = select_cycle_data(session, cfg, lineage)

    assert [t.id for t in data.used] == [ids["ok"], ids["ok_c1"]]
    expected = {
        "reserved": "reserved_for_eval",
        "eval_task": "eval_task",
        "no_reward": "no_reward",
        "stale_gen": "stale_generations",
        "unknown": "unknown_checkpoint",
        "stale_hours": "stale_hours",
        "erased": "erased",
        "no_tokens": "no_completion_tokens",
        "no_segments": "no_segments",
        "wrong_spec": "no_reward",
    }
    assert data.excluded == {str(ids[k]): v for k, v in expected.items()}
    assert str(provisional) not in data.excluded and str(ancient) not in data.excluded
    assert data.older_than_window == 1
    ok = data.used[0]
    assert len(ok.segments) == 2 and ok.reward == 1.0 and ok.group == "t1"
    assert ok.completion_tokens == 6 and len(ok.event_ids) == 2
    assert ok.offsets == {"editor.interactions:0": [0, 15]}
    # the high-water mark is the last used trajectory in (finalized_at, id) order
    assert data.watermark == max((data_finalized(session, t.id), t.id) for t in data.used)
    section = data.manifest_section()
    assert section["excluded_counts"]["no_reward"] == 2 and len(section["trajectories"]) == 2


def data_finalized(session, tid):
    from app.models import Trajectory

    return session.get(Trajectory, tid).finalized_at


def _register(session, checkpoint_id, parent_id, trajectories):
    """What a succeeded cycle leaves behind: the candidate row and its lineage rows."""
    from app.repositories.checkpoints import add_checkpoint, add_checkpoint_trajectories

    add_checkpoint(
        session, checkpoint_id=checkpoint_id, path=f"/nowhere/{checkpoint_id}", parent_id=parent_id, generation=4
    )
    add_checkpoint_trajectories(session, checkpoint_id, [(t.id, t.user_id, t.task_id) for t in trajectories])
    session.commit()


def test_cap_defers_and_lineage_marks_used(session, lineage):
    now = datetime.now(UTC)
    ts = [
        insert_trajectory(
            session, segments=[SEG], reward=float(i), checkpoint_id="c3", finalized_at=now - timedelta(minutes=50 - i)
        )
        for i in range(6)
    ]
    session.commit()
    cfg = DataConfig(max_trajectories=3)
    first = select_cycle_data(session, cfg, lineage)
    assert [t.id for t in first.used] == ts[:3]
    assert first.excluded == {str(t): "deferred" for t in ts[3:]}
    assert first.watermark[1] == ts[2]
    _register(session, "cand-1", "c3", first.used)

    # a trajectory finalized *behind* the first cycle's high-water mark (closed by its signal
    # window, committed late) is still new: lineage, not a timestamp, decides
    late = insert_trajectory(
        session, segments=[SEG], reward=1.0, checkpoint_id="c3", finalized_at=now - timedelta(minutes=55)
    )
    session.commit()
    second = select_cycle_data(session, DataConfig(max_trajectories=10), lineage)
    assert [t.id for t in second.used] == [late] + ts[3:]
    assert second.excluded == {str(t): "earlier_cycle" for t in ts[:3]}


def test_equal_finalized_at_is_split_by_id(session, lineage):
    # one consumer transaction finalizes many trajectories at the same instant: the cap must not
    # lose or repeat any of them
    at = datetime.now(UTC) - timedelta(minutes=5)
    ts = sorted(
        insert_trajectory(session, segments=[SEG], reward=1.0, checkpoint_id="c3", finalized_at=at) for _ in range(4)
    )
    session.commit()
    cfg = DataConfig(max_trajectories=2)
    first = select_cycle_data(session, cfg, lineage)
    _register(session, "cand-1", "c3", first.used)
    second = select_cycle_data(session, cfg, lineage)
    assert [t.id for t in first.used] + [t.id for t in second.used] == ts

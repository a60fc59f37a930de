"""The loop's outcome read from the store (``ops.loop_outcome``, the bench's figures): each cycle's gate
decision, what production served after it, eval seconds."""

from __future__ import annotations

import uuid
from datetime import timedelta

import pytest

from app.models import GateDecision, Promotion
from app.repositories.checkpoints import add_checkpoint
from evals import store
from ops.loop_outcome import eval_seconds, served_after_cycles, succeeded_cycles

pytestmark = pytest.mark.integration


def test_served_checkpoint_per_cycle_and_eval_seconds(session):
    for cid in ("base", "c1", "c2", "c3", "planted"):
        add_checkpoint(session, checkpoint_id=cid, path=f"/x/{cid}")
    for cid in ("base", "c1", "c3"):  # cycle 2's candidate was rejected
        session.add(
            Promotion(id=uuid.uuid4(), kind="initial" if cid == "base" else "promotion", checkpoint_id=cid, actor="t")
        )
    for cid, seconds in (("c1", 12.5), ("base", 7.0)):
        run = store.create_run(session, cid, "functions", "1-x", {})
        store.finish_run(session, run, "succeeded", {})
        run.finished_at = run.started_at + timedelta(seconds=seconds)
    store.create_run(session, "planted", "functions", "1-x", {})  # unfinished: not counted
    session.flush()
    session.add(
        GateDecision(
            id=uuid.uuid4(), candidate_id="c2", production_id="c1", passed=False, decision="fail", reasons=[], report={}
        )
    )
    served = served_after_cycles(session, ["c1", "c2", "c3"])
    assert [(p["candidate"], p["promoted"], p["promoted_by"], p["checkpoint"], p["decision"]) for p in served] == [
        ("c1", True, "t", "c1", None),
        ("c2", False, None, "c1", "fail"),
        ("c3", True, "t", "c3", None),
    ]
    assert eval_seconds(session) == pytest.approx(19.5)


def test_the_loops_cycles_leave_out_a_cycle_on_a_few_stragglers(session):
    """A cycle that trained on fewer trajectories than a batch's minimum (stragglers finalized after
    their batch's cycle selected its data) is not one of the loop's cycles."""
    from datetime import UTC, datetime

    from app.models import TrainingCycle

    start = datetime(2100, 1, 1, tzinfo=UTC)  # after any cycle another test left in the database
    since = start - timedelta(minutes=1)
    for i, (cid, n) in enumerate((("c1", 227), ("c2", 229), ("straggler", 1), ("c3", 232))):
        add_checkpoint(session, checkpoint_id=cid, path=f"/x/{cid}")
        session.add(
            TrainingCycle(
                id=uuid.uuid4(),
                status="succeeded",
                checkpoint_id=cid,
                num_trajectories=n,
                started_at=start + timedelta(minutes=i),
            )
        )
    session.flush()
    assert [c.checkpoint_id for c in succeeded_cycles(session, since)] == ["c1", "c2", "straggler", "c3"]
    assert [c.checkpoint_id for c in succeeded_cycles(session, since, min_trajectories=64)] == ["c1", "c2", "c3"]

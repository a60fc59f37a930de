"""A trajectory's outcome and its task's history (the difficulty estimate of implicit@3)."""

from __future__ import annotations

import random
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from consumers.rewards.difficulty import TaskHistory, solve_rate, task_histories, trajectory_outcome
from consumers.trajectory_state import empty_signals

T0 = datetime(2025, 1, 1, tzinfo=UTC)


def _signals(**kw):
    return {**empty_signals(), **kw}


@pytest.mark.parametrize(
    ("signals", "outcome"),
    [
        # the developer's verdict first: 2 of 3 decided edits accepted, whatever the tests said
        (
            _signals(
                edits={
                    "a": {"decision": "accepted"},
                    "b": {"decision": "accepted"},
                    "c": {"decision": "rejected"},
                    "d": {"decision": None},
                },
                last_test_passed=False,
            ),
            2 / 3,
        ),
        (_signals(edits={"a": {"decision": None}}, last_test_passed=True), 1.0),  # nothing decided: the tests
        (_signals(last_test_passed=False, dissatisfied_followups=0), 0.0),
        (_signals(dissatisfied_followups=2), 0.0),  # a complaint and nothing else
        (_signals(), None),  # nothing to judge by
    ],
)
def test_outcome_takes_the_most_direct_evidence(signals, outcome):
    assert trajectory_outcome(signals) == outcome


def test_history_counts_only_the_same_tasks_earlier_trajectories():
    ids = [uuid.UUID(int=i) for i in range(8)]
    rows = [
        (ids[0], "t", T0, 1.0),
        (ids[1], "t", T0 + timedelta(seconds=1), 0.0),
        (ids[2], "t", T0 + timedelta(seconds=2), None),  # no outcome: not an attempt
        (ids[3], "t", T0 + timedelta(seconds=3), 0.5),  # finalized at the same instant as ids[4]
        (ids[4], "t", T0 + timedelta(seconds=3), 1.0),
        (ids[5], "t", T0 + timedelta(seconds=4), 1.0),
        (ids[6], "other", T0 - timedelta(seconds=1), 1.0),
        (ids[7], None, T0, 1.0),
    ]
    h = task_histories(reversed(rows))
    assert h[ids[0]] == TaskHistory(0.0, 0)
    assert h[ids[1]] == TaskHistory(1.0, 1)
    assert h[ids[2]] == h[ids[3]] == h[ids[4]] == TaskHistory(1.0, 2)  # ties do not see each other
    assert h[ids[5]] == TaskHistory(2.5, 4)
    assert h[ids[6]] == TaskHistory(0.0, 0)
    assert ids[7] not in h


def test_history_is_the_same_whatever_order_the_rows_come_in():
    rng = random.Random(7)
    rows = [
        (uuid.UUID(int=rng.getrandbits(128)), f"t{rng.randrange(3)}", T0 + timedelta(seconds=rng.randrange(40)), o)
        for o in (rng.choice([None, 0.0, 1.0, 1 / 3, 0.7]) for _ in range(300))
    ]
    want = task_histories(rows)
    for _ in range(5):
        rng.shuffle(rows)
        assert task_histories(rows) == want  # exactly: the sums are taken in one order


def test_solve_rate_is_the_beta_posterior_mean():
    assert solve_rate(TaskHistory(), 1.0, 1.0) == 0.5
    assert solve_rate(TaskHistory(3.0, 4), 1.0, 1.0) == pytest.approx(4 / 6)
    assert solve_rate(TaskHistory(0.0, 8), 2.0, 2.0) == pytest.approx(2 / 12)

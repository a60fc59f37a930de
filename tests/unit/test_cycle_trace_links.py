"""Which producer spans a training cycle's span links to: spread over trajectories, within a cap."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime

from trainer.data import TrajectoryData
from trainer.trace_links import choose_producer_links


def _trajectory(n_events: int) -> TrajectoryData:
    return TrajectoryData(
        id=uuid.uuid4(),
        session_id="s",
        user_id="u",
        task_id="t",
        reward=1.0,
        group="t",
        finalized_at=datetime.now(UTC),
        segments=[],
        event_ids=[str(uuid.uuid4()) for _ in range(n_events)],
        offsets={},
        max_event_seq=None,
        serving_checkpoints=[],
    )


def _spans(trajectories, spans_per_trajectory: int) -> dict[uuid.UUID, tuple[str, str]]:
    """Each trajectory's events emitted by ``spans_per_trajectory`` producer spans, in turn."""
    out = {}
    for k, t in enumerate(trajectories):
        for i, e in enumerate(t.event_ids):
            out[uuid.UUID(e)] = (f"{k + 1:032x}", f"{i % spans_per_trajectory + 1:016x}")
    return out


def test_every_trajectory_gets_its_first_span_before_any_gets_a_second():
    trajectories = [_trajectory(6) for _ in range(5)]
    chosen, distinct = choose_producer_links(trajectories, _spans(trajectories, 3), limit=7)
    assert distinct == 15 and len(chosen) == 7
    first_round = [a["flywheel.trajectory_id"] for _, a in chosen[:5]]
    assert first_round == [str(t.id) for t in trajectories]
    assert {ref.split("-")[2] for ref, _ in chosen[5:]} == {f"{2:016x}"}  # second spans only after


def test_a_round_that_does_not_fit_is_spread_over_the_trajectories():
    trajectories = [_trajectory(2) for _ in range(100)]
    chosen, distinct = choose_producer_links(trajectories, _spans(trajectories, 1), limit=10)
    assert distinct == 100 and len(chosen) == 10
    picked = [
        trajectories.index(next(t for t in trajectories if str(t.id) == a["flywheel.trajectory_id"])) for _, a in chosen
    ]
    assert picked == list(range(0, 100, 10))


def test_a_span_shared_by_trajectories_is_linked_once_and_events_without_spans_are_skipped():
    a, b, c = _trajectory(3), _trajectory(3), _trajectory(2)
    shared = ("ab" * 16, "cd" * 8)
    spans = {uuid.UUID(e): shared for e in a.event_ids + b.event_ids}
    chosen, distinct = choose_producer_links([a, b, c], spans, limit=64)
    assert distinct == 1 and chosen == [
        (f"00-{shared[0]}-{shared[1]}-00", {"flywheel.trajectory_id": str(a.id), "flywheel.event_id": a.event_ids[0]})
    ]
    assert choose_producer_links([a], spans, limit=0) == ([], 1)

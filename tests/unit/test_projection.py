"""Trajectory projection: exact token arrays per segment, finalization, late signals, and the
property that folding batch by batch (state stored in between) equals folding at once."""

from __future__ import annotations

import copy
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.repositories.trajectories import SEGMENT_COLUMNS as DB_SEGMENT
from app.repositories.trajectories import TRAJECTORY_COLUMNS as DB_TRAJECTORY
from consumers.projection import ProjectionConfig, Projector, StoredEvent
from consumers.rewards import load_spec
from consumers.testing import generate_session
from consumers.trajectory_state import (
    SEGMENT_COLUMNS,
    TRAJECTORY_COLUMNS,
    TrajectoryState,
    new_trajectory,
    trajectory_id_for,
)
from producers.events.packing import unpack_floats, unpack_ints
from producers.events.types import (
    ContextSummarized,
    ContextSummarizedEvent,
    EditAccepted,
    EditAcceptedEvent,
    EditPersistenceMeasured,
    EditPersistenceMeasuredEvent,
    ModelResponded,
    ModelRespondedEvent,
    SessionEnded,
    SessionEndedEvent,
    SessionStarted,
    SessionStartedEvent,
    ToolCall,
    ToolExecuted,
    ToolExecutedEvent,
)

T0 = datetime(2026, 1, 1, tzinfo=UTC)
ENV = dict(session_id="s1", user_id="u1")


def _turn(seg, turn, prompt, completion, calls=(), **kw):
    return ModelRespondedEvent(
        **ENV,
        **kw,
        payload=ModelResponded(
            request_id="r",
            segment_index=seg,
            turn_index=turn,
            checkpoint_id=f"ck{seg}",
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-0.5 - i for i in range(len(completion))],
            latency_s=1.5,
            tool_calls=tuple(ToolCall(call_id=c, name="run") for c in calls),
        ),
    )


def _stored(events, start=T0, step=timedelta(seconds=1)):
    return [StoredEvent(e, i + 1, start + i * step, "topic", 0, 100 + i) for i, e in enumerate(events)]


def _fold(events, projector=None):
    projector = projector or Projector(ProjectionConfig(), [load_spec("implicit@1")])
    t = new_trajectory(events[0].event)
    for se in events:
        projector.apply(t, se)
    return t


def test_state_columns_are_exactly_the_table_columns():
    assert set(TRAJECTORY_COLUMNS) == set(DB_TRAJECTORY)
    assert set(SEGMENT_COLUMNS) == set(DB_SEGMENT)


def test_segments_hold_the_exact_tokens_mask_and_behaviour_logprobs():
    events = _stored(
        [
            SessionStartedEvent(**ENV, payload=SessionStarted(task_id="t", checkpoint_id="base")),
            _turn(0, 0, [1, 2, 3], [4, 5], calls=["c1"]),
            ToolExecutedEvent(
                **ENV,
                payload=ToolExecuted(
                    call_id="c1", name="run", ok=True, exit_code=0, output="ok", ran_tests=True, command="pytest"
                ),
            ),
            _turn(0, 1, [6], [7, 8, 9]),
            ContextSummarizedEvent(**ENV, payload=ContextSummarized(new_segment_index=1, summary="s")),
            _turn(1, 0, [10, 11], [12], calls=["c2"]),
            ToolExecutedEvent(
                **ENV, payload=ToolExecuted(call_id="c1", name="run", ok=False, exit_code=1, ran_tests=True)
            ),
        ]
    )
    t = _fold(events)
    s0, s1 = t.segments[0], t.segments[1]
    assert unpack_ints(s0.token_ids).tolist() == [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert list(s0.loss_mask) == [0, 0, 0, 1, 1, 0, 1, 1, 1]
    lp = unpack_floats(s0.behaviour_logprobs)
    assert lp.dtype == np.float32 and lp.tolist() == [0, 0, 0, -0.5, -1.5, 0, -0.5, -1.5, -2.5]
    assert s0.turn_token_offsets == [0, 5] and s0.num_completion_tokens == 5 and s0.num_turns == 2
    assert unpack_ints(s1.token_ids).tolist() == [10, 11, 12] and s1.checkpoint_id == "ck1"
    # the late result of c1 goes to the segment whose turn made the call
    assert [r["call_id"] for r in s0.tool_results] == ["c1", "c1"] and s1.tool_results == []
    assert s1.event_ids == [events[4].event.event_id, events[5].event.event_id]
    assert s0.min_offset == {"topic:0": 101} and s0.max_offset == {"topic:0": 106}
    assert (t.num_segments, t.num_turns, t.completion_tokens, t.ran_tests) == (2, 3, 6, True)
    assert t.test_commands == ["pytest"] and t.signals["last_test_passed"] is False
    assert t.id == trajectory_id_for("s1") and t.status == "provisional" and t.max_event_seq == 7


def _session_with_late_signal():
    return [
        SessionStartedEvent(**ENV, payload=SessionStarted(task_id="t", checkpoint_id="base")),
        _turn(0, 0, [1], [2, 3]),
        EditAcceptedEvent(**ENV, payload=EditAccepted(edit_id="e1")),
        SessionEndedEvent(**ENV, payload=SessionEnded(expected_signals=("edit.persistence_measured",))),
        EditPersistenceMeasuredEvent(
            **ENV, payload=EditPersistenceMeasured(edit_id="e1", fraction_persisted=1.0, delay_s=60)
        ),
    ]


def test_finalized_when_the_expected_signal_arrives_with_one_label_per_spec():
    specs = [load_spec("implicit@1"), load_spec("implicit@2")]
    events = _stored(_session_with_late_signal())
    t = _fold(events[:4], Projector(ProjectionConfig(), specs))
    assert t.status == "provisional" and t.window_closes_at == events[3].ingested_at + timedelta(hours=1)
    p = Projector(ProjectionConfig(), specs)
    p.apply(t, events[4])
    assert t.status == "finalized" and t.finalized_by == "signals" and t.finalized_at == events[4].ingested_at
    assert [lab.spec for lab in t.labels] == ["implicit@1", "implicit@2"]
    assert t.labels[0].components["edit_persistence"] == 0.5


def test_a_signal_ingested_after_the_window_is_late_and_does_not_change_the_label():
    events = _session_with_late_signal()
    stored = _stored(events[:4]) + [StoredEvent(events[4], 5, T0 + timedelta(hours=2), "topic", 0, 104)]
    t = _fold(stored)
    assert t.status == "finalized" and t.finalized_by == "window"
    assert t.finalized_at == stored[3].ingested_at + timedelta(hours=1)
    assert t.late_event_ids == [events[4].event_id] and events[4].event_id not in t.event_ids
    assert t.labels[0].components["edit_persistence"] == 0.0
    # relabel folds every stored event: the late signal counts there
    relabeled = _fold(stored, Projector(ProjectionConfig(relabel=True), [load_spec("implicit@1")]))
    assert (
        relabeled.labels == []
        and Projector(ProjectionConfig(), [load_spec("implicit@1")]).label(relabeled)[0].components["edit_persistence"]
        == 0.5
    )


def test_a_session_that_never_ends_is_abandoned_after_its_last_event():
    events = _stored(_session_with_late_signal()[:3])
    p = Projector(ProjectionConfig(abandon_after_s=60), [load_spec("implicit@1")])
    t = _fold(events, p)
    assert t.window_closes_at == events[-1].ingested_at + timedelta(seconds=60)
    assert not p.close_if_due(t, events[-1].ingested_at + timedelta(seconds=60))
    assert p.close_if_due(t, events[-1].ingested_at + timedelta(seconds=61))
    assert t.finalized_by == "abandoned" and t.finalized_at == t.window_closes_at and len(t.labels) == 1


def test_an_empty_expectation_finalizes_at_session_end():
    t = _fold(_stored(_session_with_late_signal()[:2] + [SessionEndedEvent(**ENV, payload=SessionEnded())]))
    assert t.status == "finalized" and t.finalized_by == "signals"


class FakeStore:
    """Mimics what ``project_events`` keeps in Postgres between batches: whole rows, of which a new
    batch loads the trajectory and its open (highest-index) segment."""

    def __init__(self):
        self.trajectories: dict = {}
        self.segments: dict = {}

    def fold_batch(self, projector: Projector, batch: list[StoredEvent]) -> None:
        states = {}
        for se in batch:
            tid = trajectory_id_for(se.event.session_id)
            if tid not in states:
                if tid in self.trajectories:
                    t = copy.deepcopy(self.trajectories[tid])
                    idx = [i for (x, i) in self.segments if x == tid]
                    if idx:
                        t.segments[max(idx)] = copy.deepcopy(self.segments[(tid, max(idx))])
                else:
                    t = new_trajectory(se.event)
                states[tid] = t
            projector.load_segment = lambda tid_, i: copy.deepcopy(self.segments.get((tid_, i)))
            projector.apply(states[tid], se)
        for tid, t in states.items():
            for i, s in t.segments.items():
                if s.dirty:
                    s.dirty = False
                    self.segments[(tid, i)] = copy.deepcopy(s)
            row = copy.deepcopy(t)
            row.segments, row.dirty, row.labels = {}, False, []
            self.trajectories[tid] = row


def _rows(store: FakeStore):
    return (
        {k: {c: getattr(v, c) for c in TRAJECTORY_COLUMNS} for k, v in store.trajectories.items()},
        {k: {c: getattr(v, c) for c in SEGMENT_COLUMNS} for k, v in store.segments.items()},
    )


@given(seed=st.integers(0, 10_000), cuts=st.lists(st.integers(1, 200), max_size=8), out_of_order=st.booleans())
@settings(max_examples=40, deadline=None)
def test_folding_in_batches_equals_folding_at_once(seed, cuts, out_of_order):
    rng = np.random.default_rng(seed)
    events = []
    for i in range(3):
        events += generate_session(rng, session_id=f"s{i}", user_id="u", start=T0, max_segments=3, max_turns=3)
    if out_of_order:  # a turn of an earlier segment arriving after the next segment opened
        turns = [k for k, e in enumerate(events) if e.type == "model.responded" and e.payload.segment_index == 0]
        events.append(events.pop(turns[0]))
    stored = _stored(events, step=timedelta(minutes=7))  # some signals land after the window
    projector = Projector(ProjectionConfig(signal_window_s=1800), [load_spec("implicit@1")])
    once, batched = FakeStore(), FakeStore()
    once.fold_batch(projector, stored)
    bounds = sorted({c % len(stored) for c in cuts} | {0, len(stored)})
    for a, b in zip(bounds, bounds[1:]):
        batched.fold_batch(projector, stored[a:b])
    assert _rows(once) == _rows(batched)
    # and a segment's arrays always agree in length
    for s in once.segments.values():
        assert len(s.token_ids) == 4 * s.num_tokens == 4 * len(s.loss_mask) == len(s.behaviour_logprobs)
        assert sum(s.loss_mask) == s.num_completion_tokens


def test_packed_arrays_keep_the_wire_bytes_and_read_as_sequences():
    from producers.events.packing import LogProbArray, TokenArray

    ids, lps = (0, 49_151, 2**31 - 1), (-0.1, -3.25, 0.0)
    t, lp = TokenArray.of(ids), LogProbArray.of(lps)
    assert t.raw == np.asarray(ids, "<i4").tobytes() and lp.raw == np.asarray(lps, "<f4").tobytes()
    assert TokenArray.from_base64(t.to_base64()) == t and hash(TokenArray.of(list(ids))) == hash(t)
    assert len(t) == 3 and t[1] == 49_151 and t[-1] == 2**31 - 1 and t[:2] == (0, 49_151)
    assert t == ids and t == list(ids) and t != (0, 1, 2) and t != LogProbArray(t.raw)
    assert list(t) + [5] == [0, 49_151, 2**31 - 1, 5] and t + (5,) == (*ids, 5)
    assert lp.tolist() == np.asarray(lps, "<f4").tolist()
    for bad in ([2**31], [1.5], ["x"], b"\x00" * 4):
        with pytest.raises(ValueError):
            TokenArray.of(bad)
    with pytest.raises(ValueError, match="multiple of 4"):
        TokenArray(b"\x00" * 5)
    with pytest.raises(ValueError, match="not base64"):
        TokenArray.from_base64("@@@@")


def test_reserved_for_eval_is_a_stable_function_of_the_task():
    from consumers.projection import reserved_for_eval

    picked = [reserved_for_eval(f"task-{i}", 0.1) for i in range(2000)]
    assert 120 < sum(picked) < 280
    assert picked == [reserved_for_eval(f"task-{i}", 0.1) for i in range(2000)]
    assert not reserved_for_eval("task-1", 0.0)


@pytest.mark.parametrize("privacy", [False])
def test_trajectory_state_defaults_are_fresh_per_instance(privacy):
    a, b = (
        TrajectoryState(id=None, session_id="a", user_id="u", org_id="o"),
        TrajectoryState(id=None, session_id="b", user_id="u", org_id="o"),
    )
    a.event_ids.append(1)
    assert b.event_ids == []


def _moe_turn(seg, turn, prompt, completion, routes):
    """A ``model.responded`` whose completion carries routes ``[len(completion), layers, top_k]`` (or None)."""
    extra = (
        {}
        if routes is None
        else dict(routed_experts=np.asarray(routes).reshape(-1).tolist(), routed_experts_shape=np.shape(routes)[1:])
    )
    return ModelRespondedEvent(
        **ENV,
        payload=ModelResponded(
            request_id="r",
            segment_index=seg,
            turn_index=turn,
            checkpoint_id="ck",
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-0.5] * len(completion),
            latency_s=0.1,
            **extra,
        ),
    )


def test_segments_keep_the_routes_of_their_completion_tokens_one_byte_an_id():
    from app.repositories.trajectories import unpack_routes

    r0 = np.arange(2 * 3 * 2).reshape(2, 3, 2) % 8
    r1 = (np.arange(3 * 3 * 2).reshape(3, 3, 2) + 5) % 8
    t = _fold(
        _stored(
            [
                SessionStartedEvent(**ENV, payload=SessionStarted(task_id="t", checkpoint_id="ck")),
                _moe_turn(0, 0, [1, 2], [3, 4], r0),
                _moe_turn(0, 1, [5], [6, 7, 8], r1),
            ]
        )
    )
    s = t.segments[0]
    assert s.routed_experts_shape == [3, 2] and s.routed_experts_itemsize == 1
    assert len(s.routed_experts) == 5 * 3 * 2  # completion tokens x layers x top-k, one byte each
    assert unpack_routes(s.routed_experts, 1).reshape(5, 3, 2).tolist() == np.concatenate([r0, r1]).tolist()


def test_an_expert_id_past_255_widens_the_segments_routes_to_two_bytes():
    from app.repositories.trajectories import unpack_routes

    r0, r1 = np.full((1, 2, 1), 7), np.array([[[300], [9]]])
    t = _fold(_stored([_moe_turn(0, 0, [1], [2], r0), _moe_turn(0, 1, [3], [4], r1)]))
    s = t.segments[0]
    assert s.routed_experts_itemsize == 2 and len(s.routed_experts) == 2 * 2 * 2
    assert unpack_routes(s.routed_experts, 2).tolist() == [7, 7, 300, 9]


@pytest.mark.parametrize("second", ["none", "other_shape"])
def test_a_turn_without_matching_routes_empties_the_segments_routes(second):
    routes = np.zeros((1, 2, 2), dtype=int)
    other = None if second == "none" else np.zeros((1, 3, 2), dtype=int)
    t = _fold(
        _stored(
            [_moe_turn(0, 0, [1], [2], routes), _moe_turn(0, 1, [3], [4], other), _moe_turn(0, 2, [5], [6], routes)]
        )
    )  # and a later turn does not start them again
    s = t.segments[0]
    assert (bytes(s.routed_experts), s.routed_experts_shape, s.routed_experts_itemsize) == (b"", None, None)


def test_expert_ids_outside_two_bytes_are_refused_at_validation():
    from pydantic import ValidationError

    for bad in (-1, 65536):
        with pytest.raises(ValidationError, match="routed_experts: id"):
            _moe_turn(0, 0, [1], [2], np.array([[[bad]]]))

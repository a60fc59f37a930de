"""Reward specs (TOML, versioned) and the reward math."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.errors import ConfigurationError
from consumers.rewards import RewardInputs, compute_reward, inputs_from_signals, load_spec
from consumers.rewards.difficulty import TaskHistory
from consumers.rewards.math import length_penalty
from consumers.rewards.spec import SPEC_DIR, active_specs, available_specs, read_spec_file


@pytest.fixture(scope="module")
def implicit1():
    return load_spec("implicit@1")


def test_default_spec_is_implicit_1_and_every_shipped_spec_is_valid():
    specs = available_specs()
    assert {"implicit@1", "implicit@2", "implicit@3", "implicit@4"} <= set(specs)
    assert read_spec_file(SPEC_DIR / "default.toml").id == "implicit@1"
    # the digests pin the numbers: a spec that gained no setting keeps the digest it always had
    assert specs["implicit@1"].digest() == "e61c64a3dba08bca"
    assert specs["implicit@2"].digest() == "916f61218ba9dc29"
    assert specs["implicit@4"].digest() == "f9039ac28207df6e"
    assert len({s.digest() for s in specs.values()}) == len(specs)
    assert [s.id for s in specs.values() if s.needs_task_history] == ["implicit@3"]


def test_implicit_3_is_implicit_1_but_for_the_length_weight():
    one, three = load_spec("implicit@1"), load_spec("implicit@3")
    c1, c3 = one.components.model_dump(), three.components.model_dump()
    assert c3["length"].pop("difficulty") == {"prior_solved": 1.0, "prior_failed": 1.0, "floor": 0.1}
    assert c3["length"].pop("coef") == 2 * c1["length"].pop("coef")
    c1["length"].pop("difficulty")
    assert c1 == c3 and one.clip == three.clip


def test_implicit_4_scores_every_session_by_what_the_developer_kept():
    four = load_spec("implicit@4")
    kept = RewardInputs(accepted=1, persistence=(0.9,), completion_tokens=80)
    rewritten = RewardInputs(accepted=1, persistence=(0.1,), dissatisfied_followups=1, completion_tokens=80)
    rejected = RewardInputs(rejected=1, dissatisfied_followups=1, completion_tokens=80)
    nothing = RewardInputs(dissatisfied_followups=1, completion_tokens=80)
    r = {
        name: compute_reward(four, x)
        for name, x in [("kept", kept), ("rewritten", rewritten), ("rejected", rejected), ("nothing", nothing)]
    }
    # a rejected edit keeps 0 % of itself; a session without an edit kept nothing of the request
    assert r["rejected"].components["edit_persistence"] == pytest.approx(2.0 * (0.0 - 0.5))
    assert r["nothing"].components["edit_persistence"] == r["rejected"].components["edit_persistence"]
    assert r["kept"].reward > 0 > r["rewritten"].reward > r["rejected"].reward == r["nothing"].reward
    # the accept/reject click is not a component: what it says, persistence says
    assert set(r["kept"].components) == {"edit_persistence", "dissatisfied_followups", "latency", "length"}
    # one kept and one rejected edit: the mean over both proposals
    half = compute_reward(four, RewardInputs(accepted=1, rejected=1, persistence=(1.0,)))
    assert half.components["edit_persistence"] == pytest.approx(0.0)
    # without the setting, rejected edits and edit-less sessions leave persistence out, as before
    assert compute_reward(load_spec("implicit@1"), rejected).components["edit_persistence"] == 0.0


def test_a_spec_with_an_unknown_field_is_refused_with_the_reason(tmp_path):
    (tmp_path / "bad.toml").write_text('name = "x"\nversion = 1\n[components.length]\ncoef = 1\nshape = "cubic"\n')
    with pytest.raises(ConfigurationError) as err:
        read_spec_file(tmp_path / "bad.toml")
    assert any("shape" in r for r in err.value.reasons)


def test_two_files_with_one_id_and_different_numbers_is_an_error(tmp_path):
    (tmp_path / "clash.toml").write_text('name = "implicit"\nversion = 1\n[components.length]\ncoef = 9\n')
    with pytest.raises(ConfigurationError, match="defined twice"):
        available_specs(tmp_path)


def test_unknown_spec_lists_what_exists():
    with pytest.raises(ConfigurationError, match="implicit@1"):
        load_spec("implicit@99")


@given(
    t=st.integers(0, 200_000),
    d=st.integers(1, 5_000),
    gap=st.integers(1, 200_000),
    kind=st.sampled_from(["log1p", "sqrt"]),
)
@settings(max_examples=200, deadline=None)
def test_length_penalty_is_decreasing_and_concave(t, d, gap, kind):
    f = lambda x: length_penalty(x, kind, 0.15, 512.0)  # noqa: E731
    assert f(0) == 0.0
    assert f(t + d) <= f(t)
    # the marginal cost of d more tokens falls as the trajectory grows
    assert (f(t) - f(t + d)) >= (f(t + gap) - f(t + gap + d)) - 1e-12


def test_marginal_length_cost_falls_an_order_of_magnitude(implicit1):
    short = (
        compute_reward(implicit1, RewardInputs(completion_tokens=100)).components["length"]
        - compute_reward(implicit1, RewardInputs(completion_tokens=200)).components["length"]
    )
    long = (
        compute_reward(implicit1, RewardInputs(completion_tokens=10_000)).components["length"]
        - compute_reward(implicit1, RewardInputs(completion_tokens=10_100)).components["length"]
    )
    assert short > 10 * long > 0


def test_accepted_and_persisted_beats_rejected(implicit1):
    good = compute_reward(implicit1, RewardInputs(accepted=2, persistence=(1.0, 0.9), completion_tokens=300))
    reverted = compute_reward(implicit1, RewardInputs(accepted=2, persistence=(0.0, 0.1), completion_tokens=300))
    rejected = compute_reward(implicit1, RewardInputs(rejected=2, completion_tokens=300))
    assert good.reward > reverted.reward > rejected.reward
    assert good.components["edit_accepted"] == 1.0 and rejected.components["edit_rejected"] == -1.0
    assert reverted.components["edit_persistence"] < 0 < good.components["edit_persistence"]


def test_components_sum_to_the_reward_and_penalties_are_capped(implicit1):
    r = compute_reward(
        implicit1,
        RewardInputs(
            accepted=1,
            rejected=1,
            persistence=(0.5,),
            dissatisfied_followups=10,
            latency_s=1000.0,
            completion_tokens=2048,
        ),
    )
    assert r.components["dissatisfied_followups"] == -0.5 * 3  # cap = 3
    assert r.components["latency"] == pytest.approx(-0.1 * 3.0)  # max_units = 3
    assert r.reward == pytest.approx(sum(r.components.values()))
    assert r.components["length"] == pytest.approx(-0.15 * math.log1p(4.0))


def test_test_outcome_only_in_the_spec_that_enables_it():
    inputs = RewardInputs(last_test_passed=True)
    assert "test_outcome" not in compute_reward(load_spec("implicit@1"), inputs).components
    assert compute_reward(load_spec("implicit@2"), inputs).components["test_outcome"] == 0.5


@given(
    accepted=st.integers(0, 50),
    rejected=st.integers(0, 50),
    persistence=st.lists(st.floats(0, 1), max_size=10),
    dissatisfied=st.integers(0, 100),
    latency=st.floats(0, 1e6),
    tokens=st.integers(0, 10**7),
    passed=st.sampled_from([None, True, False]),
)
@settings(max_examples=200, deadline=None)
def test_reward_is_finite_and_inside_the_clip(accepted, rejected, persistence, dissatisfied, latency, tokens, passed):
    for spec_id in ("implicit@1", "implicit@2"):
        spec = load_spec(spec_id)
        r = compute_reward(
            spec, RewardInputs(accepted, rejected, tuple(persistence), dissatisfied, latency, tokens, passed)
        )
        assert math.isfinite(r.reward) and spec.clip[0] <= r.reward <= spec.clip[1]
        assert r == compute_reward(
            spec, RewardInputs(accepted, rejected, tuple(persistence), dissatisfied, latency, tokens, passed)
        )


def test_inputs_from_signals_uses_the_last_decision_and_only_measured_accepted_edits():
    signals = {
        "edits": {
            "a": {"decision": "accepted", "persisted": 0.8},
            "b": {"decision": "rejected", "persisted": 0.3},
            "c": {"decision": "accepted", "persisted": None},
            "d": {"decision": None, "persisted": None},
        },
        "dissatisfied_followups": 2,
        "latency_s": 12.5,
        "last_test_passed": False,
    }
    i = inputs_from_signals(signals, completion_tokens=77)
    assert (
        i.accepted,
        i.rejected,
        i.persistence,
        i.dissatisfied_followups,
        i.latency_s,
        i.completion_tokens,
        i.last_test_passed,
    ) == (2, 1, (0.8,), 2, 12.5, 77, False)


def _length(spec, tokens: int, history: TaskHistory = TaskHistory()) -> float:
    return compute_reward(spec, RewardInputs(completion_tokens=tokens, task_history=history)).components["length"]


def test_difficulty_weighs_length_by_the_tasks_solve_rate():
    """implicit@3 (ALP): for the same tokens, a task its earlier trajectories solved pays more than
    one they failed; a task never seen pays implicit@1's penalty; a task never solved pays the floor."""
    one, three = load_spec("implicit@1"), load_spec("implicit@3")
    easy, hard, unseen = TaskHistory(solved=9.0, attempts=10), TaskHistory(solved=1.0, attempts=10), TaskHistory()
    for tokens in (50, 700, 4000):
        assert _length(three, tokens, easy) < _length(three, tokens, unseen) < _length(three, tokens, hard) < 0
        assert _length(three, tokens, unseen) == _length(one, tokens)
        assert _length(three, tokens, easy) == pytest.approx(0.3 * 10 / 12 * -math.log1p(tokens / 512), abs=1e-9)
        never = _length(three, tokens, TaskHistory(solved=0.0, attempts=1000))
        assert never == pytest.approx(-0.3 * 0.1 * math.log1p(tokens / 512), abs=1e-9)
    # the task's history moves only the length component
    base = dict(accepted=1, rejected=1, persistence=(0.7,), dissatisfied_followups=1, latency_s=90.0)
    a = compute_reward(three, RewardInputs(**base, completion_tokens=900, task_history=easy))
    b = compute_reward(three, RewardInputs(**base, completion_tokens=900, task_history=hard))
    assert {k: v for k, v in a.components.items() if k != "length"} == {
        k: v for k, v in b.components.items() if k != "length"
    }
    assert a.reward < b.reward
    # a spec without `difficulty` ignores the history
    assert _length(one, 900, easy) == _length(one, 900, hard)


@given(
    solved=st.integers(0, 200),
    more=st.integers(0, 200),
    tokens=st.integers(0, 10**6),
)
@settings(max_examples=200, deadline=None)
def test_difficulty_weight_rises_with_solve_rate_and_stays_between_floor_and_one(solved, more, tokens):
    three = load_spec("implicit@3")
    lower = TaskHistory(solved=float(solved), attempts=solved + more)
    higher = TaskHistory(solved=float(solved + more), attempts=solved + more)
    assert _length(three, tokens, higher) <= _length(three, tokens, lower) <= 0
    plain = length_penalty(tokens, "log1p", 0.3, 512.0)
    assert plain - 1e-9 <= _length(three, tokens, higher) and _length(three, tokens, lower) <= 0.1 * plain + 1e-9


def test_a_spec_that_reads_task_history_cannot_be_active(monkeypatch):
    from consumers.settings import get_consumer_settings

    monkeypatch.setenv("FLYWHEEL_CONSUMER_REWARD_SPECS", '["implicit@1","implicit@3"]')
    get_consumer_settings.cache_clear()
    try:
        with pytest.raises(ConfigurationError, match="flywheel relabel --spec implicit@3"):
            active_specs()
        monkeypatch.setenv("FLYWHEEL_CONSUMER_REWARD_SPECS", '["implicit@1","implicit@2"]')
        get_consumer_settings.cache_clear()
        assert [s.id for s in active_specs()] == ["implicit@1", "implicit@2"]
    finally:
        get_consumer_settings.cache_clear()


def test_a_difficulty_setting_out_of_range_is_refused(tmp_path):
    (tmp_path / "bad.toml").write_text(
        'name = "x"\nversion = 1\n[components.length]\ncoef = 1\n[components.length.difficulty]\nfloor = 2\n'
    )
    with pytest.raises(ConfigurationError) as err:
        read_spec_file(tmp_path / "bad.toml")
    assert any("difficulty.floor" in r for r in err.value.reasons)

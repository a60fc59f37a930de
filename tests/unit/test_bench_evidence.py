"""bench/evidence.py: the bench's held-out figure from the report split (never gated) with the last
candidate beside production, and the one-cycle contrast's twins, difference and spread."""

from __future__ import annotations

import pytest

from bench import evidence

RATES = {"base": 0.20, "c1": 0.25, "c2": 0.30, "c3": 0.22, "t0": 0.26, "t1": 0.22, "s0": 0.21, "s1": 0.23}


@pytest.fixture
def store(monkeypatch):
    """``paired`` over a store where each checkpoint has the pass rate above on the report split."""
    calls = []

    def paired(session, base, final, suite, *, by_template=False):
        calls.append((base, final, suite, by_template))
        diff = RATES[final] - RATES[base]
        return {"pairs": 216, "samples": 4, "cluster": "template" if by_template else "task",
                "base": RATES[base], "final": RATES[final], "diff": diff,
                "ci": [diff - 0.05, diff + 0.05], "lower_bound": diff - 0.04}  # fmt: skip

    monkeypatch.setattr(evidence, "paired", paired)
    return calls


def test_held_out_comes_from_the_report_split_with_the_last_candidate_beside_production(store):
    out = evidence.held_out_report(None, "c2", ["c1", "c2", "c3"])
    assert out["split"] == "report" and out["suite"] == "functions_report" and out["gated"] is False
    assert out["checkpoint"] == "c2" and out["final"] == 0.30 and out["cluster"] == "template"
    assert out["last_candidate"]["checkpoint"] == "c3" and out["last_candidate"]["diff"] == pytest.approx(0.02)
    assert [c["checkpoint"] for c in out["candidates"]] == ["c1", "c2", "c3"]
    assert {c[2] for c in store} == {"functions_report"} and all(c[3] for c in store)  # template-clustered
    assert evidence.held_out_report(None, "base", [])["last_candidate"]["checkpoint"] == "base"


def test_fresh_reports_base_and_whether_it_can_move_either_way():
    ab = {"pairs": 335, "tasks": 67, "samples": 5, "base": 0.22, "final": 0.27, "diff": 0.05, "ci": [0.0, 0.1]}
    out = evidence.fresh_view({**ab, "lower_bound": 0.01})
    assert out["split"] == "fresh" and out["base"] == 0.22 and out["base_in_target"] is True
    assert out["min_skeleton_distance"] == 3 and out["lower_bound"] == 0.01
    assert evidence.fresh_view({**ab, "base": 0.05})["base_in_target"] is False


def test_the_one_cycle_contrast_reports_each_twin_the_difference_and_the_spread(store):
    arms = {"true": {0: "t0", 1: "t1"}, "shuffled": {0: "s0", 1: "s1"}}
    out = evidence.one_cycle_contrast(None, "c1", arms)
    assert out["twins"] == 2 and out["split"] == "report" and out["data_of"] == "c1"
    assert [t["checkpoint"] for t in out["arms"]["true"]] == ["t0", "t1"]
    assert [c["seed"] for c in out["true_vs_shuffled"]] == [0, 1]
    assert out["true_vs_shuffled"][0]["diff"] == pytest.approx(0.26 - 0.21)  # true minus shuffled, same seed
    assert out["diff"] == pytest.approx(((0.26 - 0.21) + (0.22 - 0.23)) / 2)
    assert out["spread"]["true"] == pytest.approx(0.04) and out["spread"]["shuffled"] == pytest.approx(0.02)
    assert out["spread"]["max"] == pytest.approx(0.04)


def test_the_arms_reuse_a_true_twin_already_trained_and_shuffle_within_groups(monkeypatch):
    trained = []

    def train(env, data_of, *, trainer_config=None, seed=None, placebo=None, invert=False):
        trained.append((seed, placebo))
        return f"{'s' if placebo else 't'}{seed}"

    monkeypatch.setattr(evidence, "train_from_base", train)
    arms = evidence.one_cycle_arms({}, "c1", [0, 1], None, {0: "control"})
    assert arms == {"true": {0: "control", 1: "t1"}, "shuffled": {0: "s0", 1: "s1"}}
    assert trained == [(0, "within_group"), (1, None), (1, "within_group")]

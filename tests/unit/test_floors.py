"""Suite floors (evals/gate/floors.py): known bounds, the equal candidate's refusal rate, the shipped
floors against the documented counts, and the policy file written with its comments kept."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from app.core.errors import ConfigurationError
from app.core.intervals import wilson_interval, wilson_lower
from evals.gate.decision import decide_gate
from evals.gate.floors import FLOOR_STEP, derive_floor, design_effect, equal_refusal, round_down
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GATE_TOML, load_gate_config, write_floors


def outcomes(k: int, n: int) -> list[bool]:
    return [True] * k + [False] * (n - k)


def test_the_one_sided_wilson_bound_is_the_two_sided_one_at_twice_the_tail():
    assert wilson_lower(19 / 112, 112, 0.99) == pytest.approx(wilson_interval(19, 112, 0.98)[0], abs=1e-12)
    assert wilson_lower(19 / 112, 112, 0.99) == pytest.approx(0.10287, abs=1e-5)
    assert wilson_lower(0.0, 100, 0.99) == 0.0 and wilson_lower(0.5, 0, 0.99) == 0.0
    # a smaller effective sample size lowers the bound
    assert wilson_lower(19 / 112, 112 / 3, 0.99) < wilson_lower(19 / 112, 112, 0.99)
    with pytest.raises(ValueError):
        wilson_lower(1.5, 10)


@pytest.mark.parametrize(
    ("k", "n", "bound", "floor", "refused"),
    [
        (19, 112, 0.1029, 0.085, 0.0051),  # SmolLM2 base, functions held out (greedy)
        (6, 164, 0.0147, 0.005, 0.0022),  # SmolLM2 base, HumanEval (greedy)
        (0, 100, 0.0, 0.0, 0.0),  # DataFrameBench: a measured 0 gives 0
        (3, 100, 0.0086, 0.0, 0.0),  # 0.005 would refuse the 4.8 % of equal candidates scoring 0
        (50, 100, 0.3867, 0.38, 0.006),
        (112, 112, 0.9539, 0.95, 0.0),
    ],
)
def test_known_counts_give_known_floors(k, n, bound, floor, refused):
    e = derive_floor(outcomes(k, n))
    assert (e.passed, e.n, e.clusters, e.design_effect) == (k, n, n, 1.0)
    assert e.lower_bound == pytest.approx(bound, abs=1e-4)
    assert e.floor == floor and e.floor <= e.lower_bound
    assert e.equal_refusal == pytest.approx(refused, abs=1e-4)
    assert round(e.floor / FLOOR_STEP, 9) == int(round(e.floor / FLOOR_STEP))


def test_the_rounded_wilson_bound_alone_would_refuse_too_many_equal_candidates():
    """Why the floor steps down from the bound: 19/112's 99 % bound 0.103 rounds to 0.10, which an
    equal candidate (Binomial(112, 19/112)) falls below 2.4 % of the time."""
    assert round_down(wilson_lower(19 / 112, 112, 0.99)) == 0.1
    assert equal_refusal(0.1, 112, 19 / 112) == pytest.approx(0.0239, abs=1e-4)
    assert equal_refusal(0.085, 112, 19 / 112) <= 0.01


@pytest.mark.parametrize(("k", "n"), [(19, 112), (20, 112), (6, 164), (1, 20), (5, 20), (45, 112), (400, 896)])
def test_an_equal_candidate_is_refused_at_most_one_percent_of_the_time(k, n):
    """200,000 seeded binomial draws of a candidate whose true rate is the measured one: the share
    that scores below the floor (the gate refuses rate < floor) is <= 1 % and matches the exact tail."""
    e = derive_floor(outcomes(k, n))
    rates = np.random.default_rng(k * 1000 + n).binomial(n, k / n, size=200_000) / n
    simulated = float(np.mean(rates < e.floor))
    assert simulated <= 0.01 + 3 * np.sqrt(0.01 * 0.99 / 200_000)
    assert simulated == pytest.approx(e.equal_refusal, abs=0.002)


def clustered_suite(seed: int = 0) -> tuple[list[bool], list[int]]:
    """21 templates of 3-8 tasks whose pass probability is the template's (held-out functions' shape)."""
    rng = np.random.default_rng(seed)
    passed, clusters = [], []
    for t, (size, p) in enumerate(zip(rng.integers(3, 9, size=21), rng.choice([0, 0, 0, 0.05, 0.2, 0.5, 0.9], 21))):
        passed += [bool(x) for x in rng.random(size) < p]
        clusters += [t] * int(size)
    return passed, clusters


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clustered_outcomes_widen_the_bound_and_an_equal_candidate_stays_near_one_percent(seed):
    """A template-clustered suite: the design effect is above 1, the floor at or below the unclustered
    one, and a candidate equal in distribution (a cluster bootstrap of the measured templates) falls
    below it at most ~1 % of the time (the design-effect binomial is an approximation: <= 1.5 %)."""
    passed, clusters = clustered_suite(seed)
    e = derive_floor(passed, clusters)
    assert e.design_effect > 1.5 and e.clusters == 21
    assert e.floor <= derive_floor(passed).floor and e.equal_refusal <= 0.01
    arr, ids = np.array(passed, dtype=float), np.array(clusters)
    totals = np.array([arr[ids == t].sum() for t in range(21)])
    sizes = np.array([(ids == t).sum() for t in range(21)])
    draw = np.random.default_rng(seed).integers(0, 21, size=(50_000, 21))
    rates = totals[draw].sum(axis=1) / sizes[draw].sum(axis=1)
    assert float(np.mean(rates < e.floor)) <= 0.015


def test_design_effect_is_one_without_clusters_and_errors_are_clear():
    assert design_effect([True, False, True], [0, 1, 2]) == 1.0
    assert design_effect([False] * 6, [0, 0, 1, 1, 2, 2]) == 1.0  # a rate of 0 has no variance to inflate
    with pytest.raises(ValueError, match="one cluster per outcome"):
        design_effect([True], [0, 1])
    with pytest.raises(ValueError, match="no outcomes"):
        derive_floor([])


def test_the_shipped_floors_are_the_rule_applied_to_the_documented_base_counts():
    """evals/gate.toml's floors are derive_floor of SmolLM2-135M-Instruct base's greedy counts:
    functions 19/112 (docs/benchmarks.md), HumanEval 6/164 and DataFrameBench ~0 (docs/gate.md)."""
    policy = load_gate_config()
    assert policy.for_suite("functions").floor == derive_floor(outcomes(19, 112)).floor == 0.085
    assert policy.for_suite("humaneval").floor == derive_floor(outcomes(6, 164)).floor == 0.005
    assert policy.for_suite("dataframebench").floor == derive_floor(outcomes(0, 100)).floor == 0.0


def gate_functions(cand_passed: int, prod_passed: int = 19, n: int = 112, policy=None):
    """The bench's gate (shipped policy, --gate-on functions) on n greedy pairs; the candidate keeps
    production's passes where it can (the least churn that reaches its count)."""
    cand = [Outcome(f"t{i:04d}", 0, i < cand_passed) for i in range(n)]
    prod = [Outcome(f"t{i:04d}", 0, i < prod_passed) for i in range(n)]
    policy = policy or load_gate_config().gating_only(["functions"])
    return decide_gate(
        {"functions": SuiteOutcomes("functions", "v", cand)},
        {"functions": SuiteOutcomes("functions", "v", prod)},
        policy,
    )


def floor_reason(result):
    return next(r for r in result.reasons if r.check == "floor")


@pytest.mark.parametrize("cand_passed", [10, 16, 19, 22, 45])
def test_candidates_near_base_are_not_refused_by_the_floor(cand_passed):
    """Cycle candidates and the bench's control score 14-40 % (16-45 of 112) against base's 19/112:
    the floor passes them all, whatever the margin decides; 10/112 is the lowest score it passes."""
    assert floor_reason(gate_functions(cand_passed)).passed


@pytest.mark.parametrize("cand_passed", [1, 9])
def test_a_broken_candidate_may_be_refused_by_the_floor(cand_passed):
    """The planted inverted-reward candidates scored 1-14 of 112: at 9 or fewer the floor refuses too."""
    r = gate_functions(cand_passed)
    assert not floor_reason(r).passed and not r.passed


def test_smoke_runs_drop_the_floors_sized_for_the_whole_suite():
    """4 tasks that neither side solves (the demo's smoke gate): the 8.5 % floor would fail it;
    --min-pairs / FLYWHEEL_EVAL_MIN_PAIRS sets every floor to 0, so it stays insufficient evidence."""
    policy = load_gate_config().gating_only(["functions"])
    assert not floor_reason(gate_functions(0, 0, 4, policy.model_copy())).passed
    smoke = policy.with_min_pairs(4)
    assert {s.floor for s in smoke.suites.values()} == {0.0}
    assert floor_reason(gate_functions(0, 0, 4, smoke)).passed


POLICY = """\
# the head comment stays
method = "newcombe"

[suites.a]
gated = true                  # first key's comment
floor = 0.0                   # old note, line one
                              # old note, line two
min_pairs = 3                 # stays
                              # stays too

[suites.b]
gated = true
allow_empty = true            # b's last key
                              # b's last key, continued

# a block about the monitors that follows
[[monitors]]
metric = "edit_rate"
worse = "decrease"
abs_tolerance = 0.05
"""


def test_write_floors_changes_only_the_floor_lines(tmp_path: Path):
    path = tmp_path / "gate.toml"
    path.write_text(POLICY)
    write_floors(path, {"a": (0.085, "from base 19/112"), "b": (0.005, "from base 6/164")})
    expected = POLICY.replace(
        "floor = 0.0                   # old note, line one\n                              # old note, line two\n",
        "floor = 0.085                 # from base 19/112\n",
    ).replace(
        "                              # b's last key, continued\n",
        "                              # b's last key, continued\nfloor = 0.005                 # from base 6/164\n",
    )
    assert path.read_text() == expected
    policy = load_gate_config(path)
    assert (policy.for_suite("a").floor, policy.for_suite("b").floor, policy.for_suite("a").min_pairs) == (
        0.085,
        0.005,
        3,
    )


def test_write_floors_refuses_what_it_cannot_write(tmp_path: Path):
    path = tmp_path / "gate.toml"
    path.write_text(POLICY)
    with pytest.raises(ConfigurationError, match=r"no \[suites.c\] table"):
        write_floors(path, {"c": (0.1, "x")})
    with pytest.raises(ConfigurationError, match="invalid"):
        write_floors(path, {"a": (1.5, "x")})
    assert path.read_text() == POLICY
    with pytest.raises(ConfigurationError, match="not found"):
        write_floors(tmp_path / "missing.toml", {"a": (0.1, "x")})


def test_the_shipped_policy_round_trips(tmp_path: Path):
    path = tmp_path / "gate.toml"
    path.write_text(GATE_TOML.read_text())
    policy = load_gate_config(path)
    write_floors(path, {n: (policy.for_suite(n).floor, "same number") for n in ("functions", "humaneval")})
    assert load_gate_config(path) == policy
    changed = [
        (a, b) for a, b in zip(GATE_TOML.read_text().splitlines(), path.read_text().splitlines(), strict=True) if a != b
    ]
    assert [b.split("#")[0].strip() for _, b in changed] == ["floor = 0.005", "floor = 0.085"]

"""pass@k against brute-force enumeration, best-of-K, and the gate with k samples per task: every
sample paired, tasks resampled as clusters, more samples more power at a bounded false-rejection rate."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from evals.gate.decision import decide_gate
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.passk import format_sampling, pass_at_k, sampling_report
from evals.gate.policy import GateConfig, SuiteGate


def brute_force_pass_at_k(n: int, c: int, k: int) -> float:
    """The share of all k-subsets of n samples (c of them passing) that hold at least one pass."""
    samples = [True] * c + [False] * (n - c)
    subsets = list(itertools.combinations(range(n), k))
    return sum(any(samples[i] for i in s) for s in subsets) / len(subsets)


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_equals_enumeration_over_all_subsets(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(brute_force_pass_at_k(n, c, k), abs=1e-12), (n, c, k)
            assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


def test_pass_at_k_is_stable_for_large_n_and_rejects_bad_counts():
    # C(1000, 500) overflows a float; the product form does not.
    exact = 1 - Fraction(math.comb(997, 500), math.comb(1000, 500))  # exact rational arithmetic
    assert pass_at_k(1000, 3, 500) == pytest.approx(float(exact), rel=1e-12)
    assert pass_at_k(10, 1, 1) == pytest.approx(0.1) and pass_at_k(10, 10, 3) == 1.0 and pass_at_k(10, 0, 10) == 0.0
    for n, c, k in ((3, 4, 1), (3, -1, 1), (3, 1, 0), (3, 1, 4)):
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def outcomes(table: dict[str, list[bool]]) -> list[Outcome]:
    return [Outcome(t, i, p) for t, ps in table.items() for i, p in enumerate(ps)]


def test_sampling_report_pass_at_1_pass_at_k_and_best_of_k():
    outs = outcomes(
        {"a": [True, False, False, False], "b": [False] * 4, "c": [True] * 4, "d": [False, True, True, False]}
    )
    r = sampling_report(outs)
    assert r.samples_per_task == 4 and r.n_tasks == 4
    assert r.pass_at_k["1"] == pytest.approx((1 / 4 + 0 + 1 + 2 / 4) / 4)
    assert r.pass_at_k["4"] == pytest.approx(3 / 4)  # with n = k, pass@k is the share of tasks with a pass
    assert r.best_of_k == pytest.approx(3 / 4) and r.best_of_k_tasks == 3
    assert format_sampling(r) == "pass@1 43.8% · pass@4 75.0% · best-of-4 75.0%"
    assert sampling_report([]) is None


def test_pass_at_1_weighs_tasks_equally_and_an_incomplete_task_is_left_out_of_best_of_k():
    outs = outcomes({"a": [True, True, True, True], "b": [False]})  # b lost 3 samples (interrupted run)
    r = sampling_report(outs, samples_per_task=4)
    assert r.pass_at_k["1"] == pytest.approx(0.5)  # mean of task means, not 4/5
    assert r.pass_at_k["4"] == 1.0 and r.best_of_k == 1.0 and r.best_of_k_tasks == 1


# ---- the gate with k samples per task --------------------------------------------------------------


def simulate(rng, p: np.ndarray, q: np.ndarray, k: int) -> tuple[list[Outcome], list[Outcome]]:
    prod = rng.random((len(p), k)) < p[:, None]
    cand = rng.random((len(q), k)) < q[:, None]
    mk = lambda m: [Outcome(f"t{t:03d}", s, bool(m[t, s])) for t in range(len(p)) for s in range(k)]  # noqa: E731
    return mk(cand), mk(prod)


def gate(cand, prod, margin: float):
    cfg = GateConfig(suites={"s": SuiteGate(margin=margin)}, bootstrap_resamples=500, monitors=[])
    return decide_gate({"s": SuiteOutcomes("s", "v", cand)}, {"s": SuiteOutcomes("s", "v", prod)}, cfg)


def test_the_gate_pairs_every_sample_and_reports_pass_at_k_per_side():
    rng = np.random.default_rng(3)
    p = rng.beta(0.7, 0.7, 30)
    cand, prod = simulate(rng, p, p, 5)
    s = gate(cand, prod, 0.1).suites["s"]
    assert s.n_pairs == 150 and s.n_tasks == 30 and s.samples_per_task == 5
    assert s.candidate_sampling.pass_at_k.keys() == {"1", "5"} and s.production_sampling.samples_per_task == 5
    per_task = [
        np.mean([c.passed for c in cand if c.task_id == t]) - np.mean([x.passed for x in prod if x.task_id == t])
        for t in sorted({o.task_id for o in cand})
    ]
    assert s.diff == pytest.approx(np.mean(per_task))
    assert s.diff == pytest.approx(s.candidate_sampling.pass_at_k["1"] - s.production_sampling.pass_at_k["1"])


def test_more_samples_per_task_separate_an_equal_from_a_worse_candidate():
    """40 tasks, p ~ Beta(0.6, 0.6); the worse candidate passes each task 30 % less often (about 15
    points), the margin is 10 points. With one sample per task the one-sided bound is too wide: the
    gate fails the equal candidate as often as not. With eight samples per task, all paired and
    resampled by task, it fails the worse one nearly always and the equal one rarely."""
    rng = np.random.default_rng(11)
    tol, sims = 0.10, 40
    failed = {("equal", 1): 0, ("equal", 8): 0, ("worse", 1): 0, ("worse", 8): 0}
    for _ in range(sims):
        p = rng.beta(0.6, 0.6, 40)
        for who, k in failed:
            failed[who, k] += not gate(*simulate(rng, p, p if who == "equal" else 0.7 * p, k), tol).passed
    rate = {key: v / sims for key, v in failed.items()}
    assert rate["worse", 8] >= 0.9 and rate["worse", 8] >= rate["worse", 1]
    assert rate["equal", 8] <= 0.1
    assert rate["equal", 1] >= 0.4  # one sample per task cannot tell the two apart


def test_samples_of_a_task_move_together_in_the_interval():
    """Tasks that are all-or-nothing (every sample agrees): eight samples per task carry no more
    information than one, and the clustered interval must not pretend they do."""
    rng = np.random.default_rng(5)
    solved_p = rng.random(30) < 0.5
    solved_c = solved_p.copy()
    solved_c[rng.choice(np.flatnonzero(solved_p), 3, replace=False)] = False
    one = gate(
        [Outcome(f"t{t}", 0, bool(solved_c[t])) for t in range(30)],
        [Outcome(f"t{t}", 0, bool(solved_p[t])) for t in range(30)],
        0.05,
    ).suites["s"]
    eight = gate(
        [Outcome(f"t{t}", s, bool(solved_c[t])) for t in range(30) for s in range(8)],
        [Outcome(f"t{t}", s, bool(solved_p[t])) for t in range(30) for s in range(8)],
        0.05,
    ).suites["s"]
    assert eight.n_pairs == 8 * one.n_pairs and eight.diff == pytest.approx(one.diff)
    assert eight.diff_low == pytest.approx(one.diff_low, abs=0.02)


def test_shipped_suites_with_several_samples_sample_at_a_temperature_and_smoke_runs_can_take_fewer():
    from evals.config import list_suites, load_suite
    from evals.gate.policy import load_gate_config

    gate = load_gate_config()
    for name in list_suites():
        s = load_suite(name)
        if s.samples_per_task > 1:
            assert s.sampling.temperature > 0, name  # greedy samples would be identical copies
            if gate.for_suite(name).gated:  # reported suites (the report split, fresh traffic) use no margin
                assert gate.for_suite(name).margin > 0.02, name  # sized margin, not the round-1 default
    many = load_suite("humaneval").with_overrides(samples_per_task=8)
    one = many.with_overrides(samples_per_task=1, limit=4)
    assert one.samples_per_task == 1 and one.limit == 4 and many.samples_per_task == 8
    assert one.fingerprint(["a"]) != many.with_overrides(limit=4).fingerprint(["a"])

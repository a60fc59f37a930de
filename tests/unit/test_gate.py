"""The gate's decisions on constructed result tables, and its intervals against known values."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evals.gate.decision import (
    decide_gate,
    mcnemar_exact_interval,
    newcombe_paired_interval,
    paired_bootstrap_interval,
    wilson_interval,
)
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GateConfig, SuiteGate


def config(**kw) -> GateConfig:
    """A policy for the interval, floor and monitor checks; at ``min_power = 0`` every suite counts
    as powered, so an interval below the margin fails (the shipped 0.8 has its own tests below)."""
    base = dict(suites={"s": SuiteGate()}, bootstrap_resamples=2000, monitors=[], min_power=0.0)
    base.update(kw)
    return GateConfig(**base)


def table(b: int, c: int, both: int, neither: int, *, samples: int = 1, **prod_kw):
    """Candidate and production outcomes with b candidate-only passes, c production-only passes."""
    pattern = [(True, False)] * b + [(False, True)] * c + [(True, True)] * both + [(False, False)] * neither
    cand, prod = [], []
    for i, (x, y) in enumerate(pattern):
        task, sample = f"t{i // samples:04d}", i % samples
        cand.append(Outcome(task, sample, x, completion_tokens=100, latency_s=1.0, tool_calls=4, edited=True))
        prod.append(
            Outcome(task, sample, y, completion_tokens=100, latency_s=1.0, tool_calls=4, edited=True, **prod_kw)
        )
    return cand, prod


def decide(cand, prod, cfg=None, *, version=("v1", "v1"), planned=None):
    cfg = cfg or config()
    return decide_gate(
        {"s": SuiteOutcomes("s", version[0], cand, planned=planned)},
        {"s": SuiteOutcomes("s", version[1], prod, planned=planned)},
        cfg,
    )


def checks(result, passed=None):
    return {r.check for r in result.reasons if passed is None or r.passed == passed}


@pytest.mark.parametrize("method", ["newcombe", "bootstrap", "mcnemar"])
def test_clear_win_passes(method):
    r = decide(*table(b=40, c=5, both=60, neither=95), config(method=method))
    assert r.passed, [x.message for x in r.failures()]
    s = r.suites["s"]
    assert s.diff == pytest.approx(35 / 200)
    assert s.diff_low > 0.0 and s.candidate_only == 40 and s.production_only == 5
    assert "non_inferiority" in checks(r, passed=True) and "floor" in checks(r, passed=True)
    assert len(s.newly_solved) == 40 and len(s.newly_broken) == 5


@pytest.mark.parametrize("method", ["newcombe", "bootstrap", "mcnemar"])
def test_clear_loss_fails(method):
    r = decide(*table(b=3, c=30, both=60, neither=107), config(method=method))
    assert not r.passed
    fail = [x for x in r.failures() if x.check == "non_inferiority"]
    assert fail and fail[0].value < -0.02 and fail[0].details["production_only"] == 30
    assert "lower bound" in fail[0].message


@pytest.mark.parametrize("method", ["newcombe", "bootstrap", "mcnemar"])
def test_noise_level_difference_passes_with_enough_pairs(method):
    # 1,000 pairs, 10 vs 12 discordant: -0.2 points, well inside the 2-point margin.
    r = decide(*table(b=10, c=12, both=500, neither=478), config(method=method))
    assert r.passed, [x.message for x in r.failures()]
    assert -0.02 < r.suites["s"].diff_low < -0.002


@pytest.mark.parametrize("method", ["newcombe", "bootstrap", "mcnemar"])
def test_noise_level_difference_on_few_pairs_is_inconclusive_and_fails(method):
    # Same point estimate sign, but 40 pairs cannot rule out a 2-point regression.
    r = decide(*table(b=3, c=4, both=15, neither=18), config(method=method))
    assert not r.passed and r.decision == "fail"  # power rule off: the margin alone decides
    assert checks(r, passed=False) == {"non_inferiority"}
    # Without the design power the same pairs are insufficient evidence, not a failure.
    r = decide(*table(b=3, c=4, both=15, neither=18), config(method=method, min_power=0.8))
    assert r.decision == "insufficient_evidence" and not r.passed
    assert {x.check for x in r.failures()} == {"non_inferiority"}
    assert all(x.inconclusive for x in r.failures()) and "insufficient evidence" in r.failures()[0].message
    power = next(x for x in r.reasons if x.check == "power")
    assert power.informational and not power.passed and power.value < 0.8


def test_identical_results_collapse_only_the_bootstrap():
    # 50 identical pairs: no pair is discordant, so every bootstrap replicate is 0 ...
    r = decide(*table(b=0, c=0, both=30, neither=20), config(method="bootstrap"))
    assert r.passed and (r.suites["s"].diff_low, r.suites["s"].diff_high) == (0.0, 0.0)
    # ... while the score interval still says what 50 pairs cannot rule out.
    r = decide(*table(b=0, c=0, both=30, neither=20))
    low, high = r.suites["s"].diff_low, r.suites["s"].diff_high
    assert -0.1 < low < -0.005 and 0.005 < high < 0.1 and low == pytest.approx(-high)


def test_zero_of_four_against_zero_of_four_is_insufficient_evidence():
    """The demo's gate: 4 tasks, min_pairs lowered to 4, both sides solve none."""
    from evals.gate.policy import load_gate_config

    cand, prod = table(b=0, c=0, both=0, neither=4)
    policy = load_gate_config().with_min_pairs(4).gating_only(["functions"])
    r = decide_gate(
        {"functions": SuiteOutcomes("functions", "v", cand)},
        {"functions": SuiteOutcomes("functions", "v", prod)},
        policy,
    )
    s = r.suites["functions"]
    assert r.decision == "insufficient_evidence" and not r.passed
    assert s.decision == "insufficient_evidence" and s.power == 0.0 and s.margin == 0.045
    assert s.diff_low < -0.35 and s.diff_high > 0.35  # one-sided 95 % Newcombe: +-0.403
    assert {x.check for x in r.failures()} == {"non_inferiority"}
    # The bootstrap alone collapses to a zero-width interval there and would pass: the gate decides
    # by its interval, so the default interval is the score interval, which keeps its width.
    r = decide(cand, prod, config(method="bootstrap", min_power=0.8))
    assert r.suites["s"].diff_low == 0.0 and r.decision == "pass" and r.suites["s"].power == 0.0


def test_a_clear_regression_fails_even_without_power():
    # 0/8 against 8/8: the whole interval lies below 0, so the few pairs are enough to fail.
    r = decide(*table(b=0, c=8, both=0, neither=0), config(min_power=0.8))
    assert r.decision == "fail" and r.suites["s"].diff_high < 0 and r.suites["s"].power < 0.8
    ni = next(x for x in r.failures() if x.check == "non_inferiority")
    assert not ni.inconclusive


def test_seed_17_cycle_2_passes_on_its_interval_at_low_power():
    """The case that showed the old power rule wrong: seed 17, cycle 2 of the bench, +3.6 points
    [+0.2, +7.3] on the held-out suite's 112 greedy pairs against its 4.5-point margin, at power
    0.23. The interval clears the margin (it even excludes 0), so the suite and the gate pass;
    power is reported beside the decision."""
    from evals.gate.plans import smaller_plan
    from evals.gate.policy import load_gate_config

    cand, prod = table(b=4, c=0, both=18, neither=90)
    # the plan the bench ran then (k = 1, 112 pairs), smaller than the shipped k = 8
    policy = smaller_plan(load_gate_config(), "functions", 1, 112).gating_only(["functions"])
    r = decide_gate(
        {"functions": SuiteOutcomes("functions", "v", cand)},
        {"functions": SuiteOutcomes("functions", "v", prod)},
        policy,
    )
    s = r.suites["functions"]
    assert (round(100 * s.diff, 1), round(100 * s.diff_low, 1), round(100 * s.diff_high, 1)) == (3.6, 0.2, 7.3)
    assert s.margin == 0.045 and s.power < 0.8 and policy.min_power == 0.8
    assert r.decision == "pass" and s.decision == "pass" and r.passed, [x.message for x in r.failures()]
    assert r.decisions()["suites"]["functions"] == {
        "decision": "pass",
        "gated": True,
        "role": "guardrail",
        "decided_by": "interval",
        "power": s.power,
        "stopped_at_pairs": 112,
        "run_stopped": False,
        "n_pairs": 112,
        "planned_pairs": None,
        "diff": s.diff,
        "low": s.diff_low,
        "high": s.diff_high,
        "sequence": [s.sequential.low, s.sequential.high],
    }


def test_an_interval_below_the_margin_fails_only_with_power():
    """Intervals that hold 0 and reach below the 4.5-point margin: on 40 pairs (power ~0.1) that is
    insufficient evidence; on 400 pairs at 5 % (power 0.88) it is a failure."""
    policy = config(suites={"s": SuiteGate(margin=0.045)}, min_power=0.8)
    for (b, c, neither), decision in (((2, 4, 34), "insufficient_evidence"), ((11, 20, 369), "fail")):
        r = decide(*table(b=b, c=c, both=0, neither=neither), policy)
        s = r.suites["s"]
        assert s.diff_low <= -0.045 and s.diff_high >= 0 and r.decision == decision
        assert (s.power >= 0.8) == (decision == "fail")


def test_too_few_pairs_is_insufficient_but_broken_results_fail():
    cand, prod = table(b=2, c=0, both=3, neither=0)
    policy = config(suites={"s": SuiteGate(min_pairs=20, margin=0.9)}, min_power=0.8)  # only the count fails
    r = decide(cand, prod, policy)
    assert r.decision == "insufficient_evidence" and checks(r, passed=False) == {"too_few_pairs"}
    r = decide(cand[:-1], prod, policy)
    assert r.decision == "fail" and {"unpaired", "too_few_pairs"} <= checks(r, passed=False)


def test_power_is_seeded_and_grows_with_pairs():
    from evals.gate.power import non_inferiority_power

    assert non_inferiority_power(4, 0.0, 0.02) == 0.0
    assert non_inferiority_power(200, 0.0, 0.02) == 1.0  # 200 agreeing pairs bound the difference at -1.3 pt
    small, large = non_inferiority_power(112, 0.18, 0.045), non_inferiority_power(896, 0.18, 0.045)
    assert small < 0.5 < 0.8 < large
    assert non_inferiority_power(112, 0.18, 0.045) == small
    with pytest.raises(ValueError):
        non_inferiority_power(10, 1.5, 0.02)


SIZED = dict(tasks=112, samples=8, margin=0.055, beta=(0.3684, 1.8611))
"""The in-reach suite at the power target (docs/gate.md): 112 tasks x 8 samples at a 5.5-point
margin, per-task pass probabilities Beta(0.368, 1.861) fitted to base's measured counts."""


def test_a_sized_suite_passes_equal_and_fails_five_points_worse_at_the_stated_rates(sims=150):
    """docs/gate.md: on a sized suite an equal candidate fails at most 5 % of the time and one 5
    points worse at least 80 % of the time. Seeded draws of both hypotheses through the gate (the
    bench's model: per-task p from the Beta, independent samples, the worse candidate shifted on the
    logit scale so the mean drops 5 points); the bounds allow ~2 Monte Carlo standard errors."""
    from scipy import optimize, special, stats

    t, k, a, b = SIZED["tasks"], SIZED["samples"], *SIZED["beta"]
    cfg = config(
        suites={"s": SuiteGate(margin=SIZED["margin"], min_pairs=t * k)}, min_power=0.8, bootstrap_resamples=1000
    )
    grid = stats.beta.ppf((np.arange(4000) + 0.5) / 4000, a, b)
    shift = optimize.brentq(lambda x: special.expit(special.logit(grid) - x).mean() - grid.mean() + 0.05, 0, 50)
    keys = [(f"t{i:04d}", j) for i in range(t) for j in range(k)]
    rng = np.random.default_rng(43)

    def gate(p, q):
        sides = [rng.random((t, k)) < x[:, None] for x in (q, p)]
        cand, prod = ([Outcome(i, j, bool(v)) for (i, j), v in zip(keys, side.ravel())] for side in sides)
        return decide(cand, prod, cfg, planned=keys)

    equal, worse = [], []
    for _ in range(sims):
        p = np.clip(rng.beta(a, b, t), 1e-9, 1 - 1e-9)
        equal.append(gate(p, p))
        worse.append(gate(p, special.expit(special.logit(p) - shift)))
    passed = np.mean([r.decision == "pass" for r in equal])
    failed = np.mean([r.decision == "fail" for r in worse])
    assert passed >= 0.95 - 0.04, passed  # false rejection <= 5 %
    assert failed >= 0.80 - 0.06, failed  # power >= 0.8
    assert min(r.suites["s"].power for r in equal) >= 0.8  # sized: the power rule never decides here


def test_missing_planned_tasks_fail_closed():
    cand, prod = table(b=10, c=0, both=50, neither=40)
    planned = [o.key for o in cand] + [("t9999", 0)]
    r = decide(cand, prod, planned=planned)
    assert not r.passed
    missing = [x for x in r.failures() if x.check == "missing_results"]
    assert {x.details["side"] for x in missing} == {"candidate", "production"}
    assert "t9999#0" in missing[0].message


def test_unpaired_outcomes_fail_closed():
    cand, prod = table(b=10, c=0, both=50, neither=40)
    r = decide(cand[:-3], prod)
    assert not r.passed
    assert "unpaired" in checks(r, passed=False)
    assert r.suites["s"].n_pairs == 97  # statistics are still reported on what pairs


def test_missing_suite_and_version_mismatch_fail_closed():
    cand, prod = table(b=10, c=0, both=50, neither=40)
    r = decide_gate({}, {"s": SuiteOutcomes("s", "v1", prod)}, config())
    assert not r.passed and checks(r, passed=False) == {"missing_suite"}
    r = decide(cand, prod, version=("v1", "v2"))
    assert not r.passed and "version_mismatch" in checks(r, passed=False)


def test_errored_sessions_and_too_few_pairs_fail_closed():
    cand, prod = table(b=5, c=0, both=5, neither=0)
    cand[0] = Outcome(cand[0].task_id, 0, False, error="sandbox crashed")
    r = decide(cand, prod, config(suites={"s": SuiteGate(min_pairs=20)}))
    assert not r.passed
    assert {"errors", "too_few_pairs"} <= checks(r, passed=False)


def test_floor_and_ungated_suites():
    cand, prod = table(b=0, c=0, both=10, neither=90)
    cfg = config(suites={"s": SuiteGate(floor=0.2), "extra": SuiteGate(gated=False)}, method="bootstrap")
    r = decide_gate(
        {"s": SuiteOutcomes("s", "v", cand), "extra": SuiteOutcomes("extra", "v", cand[:3])},
        {"s": SuiteOutcomes("s", "v", prod), "extra": SuiteOutcomes("extra", "v", prod)},
        cfg,
    )
    assert not r.passed
    assert [x.check for x in r.failures()] == ["floor"]
    assert not r.suites["extra"].gated and not r.suites["extra"].passed  # reported, not decisive


def test_an_empty_suite_is_not_gated_never_a_pass():
    """The demo's ``mined`` suite before any task was mined: 0 pairs on both sides. It is
    ``not_gated``; beside a suite that passes the gate passes, alone the gate fails."""
    empty = SuiteOutcomes("mined", "v", [], planned=[])
    r = decide_gate({"mined": empty}, {"mined": empty}, config(suites={"mined": SuiteGate()}))
    assert r.decision == "insufficient_evidence" and r.suites["mined"].decision == "insufficient_evidence"
    allowed = config(suites={"mined": SuiteGate(allow_empty=True), "s": SuiteGate()})
    r = decide_gate({"mined": empty}, {"mined": empty}, allowed.gating_only(["mined"]))
    assert r.decision == "fail" and r.suites["mined"].decision == "not_gated" and not r.suites["mined"].passed
    assert "no_gated_suites" in checks(r, passed=False)
    cand, prod = table(b=40, c=5, both=60, neither=95)
    r = decide_gate(
        {"mined": empty, "s": SuiteOutcomes("s", "v", cand)},
        {"mined": empty, "s": SuiteOutcomes("s", "v", prod)},
        allowed,
    )
    assert r.decision == "pass" and r.suites["mined"].decision == "not_gated" and r.suites["s"].decision == "pass"
    # Unrun on both sides (no results at all) is not_gated too; on one side only it fails closed.
    r = decide_gate({"s": SuiteOutcomes("s", "v", cand)}, {"s": SuiteOutcomes("s", "v", prod)}, allowed)
    assert r.decision == "pass" and r.suites["mined"].decision == "not_gated"
    r = decide_gate({"mined": empty, "s": SuiteOutcomes("s", "v", cand)}, {"s": SuiteOutcomes("s", "v", prod)}, allowed)
    assert r.decision == "fail" and r.suites["mined"].decision == "fail"
    r = decide_gate({}, {}, config(suites={}))
    assert not r.passed and r.reasons[0].check == "no_gated_suites"


def test_samples_of_one_task_are_resampled_together():
    # 4 samples per task; the clustered bootstrap interval is wider than treating 400 pairs as independent.
    cand, prod = table(b=40, c=20, both=200, neither=140, samples=4)
    keys = [o.task_id for o in cand]
    diffs = [int(x.passed) - int(y.passed) for x, y in zip(cand, prod)]
    clustered = paired_bootstrap_interval(keys, diffs, resamples=4000, seed=1)
    independent = paired_bootstrap_interval([str(i) for i in range(len(keys))], diffs, resamples=4000, seed=1)
    assert clustered[1] - clustered[0] > independent[1] - independent[0]
    assert paired_bootstrap_interval(keys, diffs, resamples=4000, seed=1) == clustered  # seeded


def test_known_interval_values():
    # Wilson (1927) for 0/10: upper 0.2775; for 5/10: (0.2366, 0.7634).
    assert wilson_interval(0, 10) == pytest.approx((0.0, 0.27753), abs=1e-4)
    assert wilson_interval(5, 10) == pytest.approx((0.23659, 0.76341), abs=1e-4)
    # Exact conditional interval: b=0 discordant of 5, n=100; Clopper-Pearson upper for p at 95 %
    # one-sided is 1 - 0.05**(1/5) = 0.4507, so the difference's upper bound is 0.05 * (2*0.4507 - 1).
    lo, hi = mcnemar_exact_interval(0, 5, 100)
    assert lo == pytest.approx(-0.05) and hi == pytest.approx(0.05 * (2 * (1 - 0.05**0.2) - 1), abs=1e-9)
    # Newcombe's paired score interval, Fagerland, Lydersen & Laake (2014)'s worked example (Cavo et
    # al. 2012: 59 both, 6 first only, 16 second only, 80 neither): 95 % two-sided -0.1186 to -0.0046.
    assert newcombe_paired_interval(59, 6, 16, 80, two_sided=True) == pytest.approx((-0.1186, -0.0046), abs=5e-5)
    # 0/4 vs 0/4, one-sided 95 %: +-z^2 / (n + z^2) = +-0.4035, not the bootstrap's (0, 0).
    assert newcombe_paired_interval(0, 0, 0, 4) == pytest.approx((-0.4035, 0.4035), abs=1e-4)
    assert newcombe_paired_interval(0, 0, 0, 0) == (-1.0, 1.0)


@settings(max_examples=200, deadline=None)
@given(st.integers(0, 60), st.integers(0, 60), st.integers(0, 200), st.sampled_from([True, False]))
def test_mcnemar_interval_contains_the_point_estimate(b, c, concordant, two_sided):
    n = b + c + concordant
    if n == 0:
        return
    lo, hi = mcnemar_exact_interval(b, c, n, two_sided=two_sided)
    assert -1.0 <= lo <= (b - c) / n + 1e-12 <= hi + 2e-12 <= 1.0 + 2e-12


@pytest.mark.parametrize("method,sims", [("mcnemar", 300), ("bootstrap", 60)])
def test_a_real_regression_rarely_passes(method, sims):
    """With a true 4-point regression on 400 pairs the gate should pass well under 5 % of the time."""
    rng = np.random.default_rng(7)
    cfg = config(method=method, bootstrap_resamples=500)
    passes = 0
    for _ in range(sims):
        u = rng.random(400)
        # P(candidate-only) = 0.03, P(production-only) = 0.07: true difference -0.04.
        b, c = int((u < 0.03).sum()), int(((u >= 0.03) & (u < 0.10)).sum())
        passes += decide(*table(b=b, c=c, both=200, neither=400 - b - c - 200), cfg).passed
    assert passes / sims <= 0.05


def test_gating_only_narrows_the_policy_explicitly():
    from app.core.errors import ConfigurationError
    from evals.gate.policy import load_gate_config

    policy = load_gate_config()
    assert {"functions", "humaneval"} <= set(policy.gated_suites())
    narrowed = policy.gating_only(["functions"])
    assert narrowed.gated_suites() == ["functions"] and set(narrowed.suites) == set(policy.suites)
    assert policy.gating_only(None) is policy
    with pytest.raises(ConfigurationError, match="no suite nope"):
        policy.gating_only(["nope"])


def test_the_gate_report_draws_a_candidate_that_passed_nothing(tmp_path):
    """0 of 112 against 19 of 112 (a planted regression's result): the PNG is written, its error
    bars never negative, where Wilson's low end at k = 0 once came out as +3e-18 and matplotlib
    refused the report (the gate command exited 1)."""
    from evals.report import render_png

    r = decide(*table(b=0, c=19, both=0, neither=93))
    assert r.decision == "fail" and r.suites["s"].candidate.low == 0.0 == r.suites["s"].candidate.rate
    out = render_png(r, tmp_path / "gate.png", "plant")
    assert out.exists() and out.stat().st_size > 0

"""Suites sized for power: the gate's ``samples`` (k per task, at the serving temperature), pairs
clustered by template, and the power reported for the plan's k x tasks pairs."""

from __future__ import annotations

import numpy as np
import pytest

from evals.config import load_suite
from evals.gate.checks import sequence_order
from evals.gate.decision import decide_gate
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GateConfig, SuiteGate, load_gate_config
from evals.gate.power import non_inferiority_power
from evals.tasks.functions import load, template_of


def test_the_gate_runs_a_suite_at_its_k_and_the_serving_temperature():
    suite = load_suite("functions")
    assert suite.samples_per_task == 1 and suite.sampling.temperature == 0.0
    sampled = GateConfig(suites={"functions": SuiteGate(samples=4)}).plan_suite(suite)
    assert sampled.samples_per_task == 4 and sampled.sampling.temperature == 0.7
    assert sampled.budget == suite.budget and sampled.split == suite.split
    tasks = ["t:abc"]
    assert sampled.fingerprint(tasks) != suite.fingerprint(tasks)  # results are never reused across k
    # k = 1 keeps the suite's own decoding; no k keeps the suite as it is.
    assert GateConfig(suites={"functions": SuiteGate(samples=1)}).plan_suite(suite).fingerprint(tasks) == (
        suite.fingerprint(tasks)
    )
    assert GateConfig().plan_suite(suite) is suite
    hot = GateConfig(suites={"functions": SuiteGate(samples=2)}, serving_temperature=1.0).plan_suite(suite)
    assert hot.sampling.temperature == 1.0
    with pytest.raises(ValueError):
        SuiteGate(samples=0)


def test_the_shipped_held_out_gate_states_its_size_and_power():
    """``evals/gate.toml`` gates the held-out suite at k = 8 samples at the serving temperature: 896
    pairs reach power 0.8 at the 4.5-point margin, where k = 1 (greedy, 112 pairs) had 0.22
    (docs/gate.md; issue 70, item 7)."""
    policy = load_gate_config()
    sg = policy.for_suite("functions")
    assert sg.samples == 8 and sg.min_pairs == 896 and sg.margin == 0.045 and policy.serving_temperature == 0.7
    tasks = len(load("test"))
    assert tasks == 112
    rate = 0.165  # base's pass rate on the held-out tasks at T = 0.7 (docs/gate.md)
    assert non_inferiority_power(tasks, rate, 0.045) < 0.25
    assert non_inferiority_power(4 * tasks, rate, 0.045) < 0.8 <= non_inferiority_power(8 * tasks, rate, 0.045)


def sampled(k: int, seed: int = 0):
    """An equal candidate on the held-out tasks at k samples each: every task's pass probability
    from base's measured Beta(0.368, 1.861), both sides drawn independently."""
    rng = np.random.default_rng(seed)
    ids = [t.id for t in load("test")]
    p = rng.beta(0.368, 1.861, len(ids))
    c, q = rng.random((len(ids), k)) < p[:, None], rng.random((len(ids), k)) < p[:, None]
    cand = [Outcome(t, s, bool(c[i, s])) for i, t in enumerate(ids) for s in range(k)]
    prod = [Outcome(t, s, bool(q[i, s])) for i, t in enumerate(ids) for s in range(k)]
    return cand, prod


def test_power_is_reported_for_the_plans_k_and_pairs_cluster_by_template():
    policy = load_gate_config().gating_only(["functions"]).model_copy(update={"bootstrap_resamples": 1000})
    cand, prod = sampled(4)
    planned = [o.key for o in prod]
    r = decide_gate(
        {"functions": SuiteOutcomes("functions", "v", cand, planned=planned)},
        {"functions": SuiteOutcomes("functions", "v", prod, planned=planned)},
        policy,
    )
    s = r.suites["functions"]
    base = sum(o.passed for o in prod) / len(prod)
    assert s.samples_per_task == 4 and s.n_pairs == s.planned_pairs == 448 and s.clusters == 21
    assert s.power == non_inferiority_power(448, base, 0.045, sims=policy.power_sims, seed=policy.seed)
    (power,) = [x for x in r.reasons if x.check == "power"]
    assert power.details["n"] == 448 and power.details["samples_per_task"] == 4 and "4 samples a task" in power.message


def test_a_stopped_run_reports_the_power_of_its_whole_plan():
    """A run stopped after 12 of 21 templates: the pairs that ran are fewer than the plan, the
    power is the plan's (448 pairs) at production's rate on the pairs that ran."""
    policy = GateConfig(
        suites={"functions": SuiteGate(margin=0.045, samples=4)},
        bootstrap_resamples=1000,
        decide_by="sequential",
        early_stop=True,
        power_sims=2000,
    )
    cand, prod = sampled(4, seed=3)
    planned = [o.key for o in prod]
    ran = set(sequence_order("functions", {template_of(o.task_id) for o in prod}, policy)[:12])
    r = decide_gate(
        {
            "functions": SuiteOutcomes(
                "functions", "v", [o for o in cand if template_of(o.task_id) in ran], planned, stopped=True
            )
        },
        {"functions": SuiteOutcomes("functions", "v", prod, planned)},
        policy,
    )
    s = r.suites["functions"]
    prefix = [o for o in prod if template_of(o.task_id) in ran]
    assert s.planned_pairs == 448 and s.n_pairs == len(prefix) < 448 and s.run_stopped
    base = sum(o.passed for o in prefix) / len(prefix)
    assert s.power == non_inferiority_power(448, base, 0.045, sims=2000)

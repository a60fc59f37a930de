"""The shipped gate (``evals/gate.toml``, what ``flywheel up``, compose and k8s run) can ship.

For every suite the shipped policy gates: a candidate identical to production at base's measured
pass rate passes that suite, and a candidate that lost two thirds of production's passes does not.
Where base passes nothing (DataFrameBench), there is nothing to lose, so the broken candidate is one
whose behaviour collapsed (it stopped editing). The whole policy, every gated suite together,
passes the identical candidate: the decision ``auto_on_pass`` acts on.
"""

from __future__ import annotations

import pytest

from evals.config import load_suite
from evals.gate.decision import decide_gate
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import load_gate_config

BASE = {
    # suite: (tasks, production's passes per sample, source of the figure)
    "functions": (112, 19 / 112, "SmolLM2-135M base, greedy, docs/benchmarks.md"),
    "humaneval": (164, 6 / 164, "base greedy, docs/gate.md"),
    "dataframebench": (100, 0.0, "base ~0 %, docs/gate.md"),
    "mined": (100, 0.25, "not yet measured: a suite of 100 mined tasks at production's ~25 % (DESIGN.md)"),
}
"""Base's measured pass rate on each gated suite and the suite's size; ``mined`` grows from
production traffic and has no measured rate yet, so it is checked at the size and rate stated."""

POLICY = load_gate_config()


def _samples(name: str) -> int:
    sg = POLICY.for_suite(name)
    return sg.samples if sg.samples is not None else load_suite(name).samples_per_task


def _task_id(name: str, i: int) -> str:
    return f"FN/t{i % 21:02d}/{i}" if name == "functions" else f"{name}/{i}"


def _outcomes(name: str, passes: set[int], *, edited: bool = True) -> list[Outcome]:
    tasks, _, _ = BASE[name]
    k = _samples(name)
    return [
        Outcome(
            _task_id(name, i),
            j,
            i * k + j in passes,
            completion_tokens=120,
            latency_s=1.0,
            tool_calls=2,
            edited=edited or i % 5 == 0,
        )
        for i in range(tasks)
        for j in range(k)
    ]


def _production_passes(name: str) -> set[int]:
    tasks, rate, _ = BASE[name]
    n = tasks * _samples(name)
    return set(range(0, n, max(1, round(1 / rate)))) if rate else set()


def _decide(name: str, cand: list[Outcome], prod: list[Outcome]):
    keys = [(o.task_id, o.sample_index) for o in prod]
    return decide_gate(
        {name: SuiteOutcomes(name, "v1", cand, planned=keys)},
        {name: SuiteOutcomes(name, "v1", prod, planned=keys)},
        POLICY.gating_only([name]),
    )


def test_every_suite_the_policy_gates_has_a_measured_base_rate():
    assert set(POLICY.gated_suites()) == set(BASE)


@pytest.mark.parametrize("name", sorted(BASE))
def test_an_identical_candidate_passes_each_gated_suite(name):
    prod = _outcomes(name, _production_passes(name))
    r = _decide(name, list(prod), prod)
    s = r.suites[name]
    assert r.decision == "pass" and s.decision == "pass", [x.message for x in r.failures()]
    assert s.n_pairs == BASE[name][0] * _samples(name)


@pytest.mark.parametrize("name", sorted(BASE))
def test_a_candidate_that_lost_two_thirds_of_productions_passes_does_not_pass(name):
    passes = sorted(_production_passes(name))
    prod = _outcomes(name, set(passes))
    if passes:
        cand = _outcomes(name, set(passes[::3]))  # keeps one pass in three
        assert len(passes[::3]) <= len(passes) / 3 + 1
    else:  # nothing to lose: the candidate stopped editing in four sessions of five
        cand = _outcomes(name, set(), edited=False)
    r = _decide(name, cand, prod)
    assert r.decision != "pass" and r.suites[name].decision != "pass"
    assert r.failures(), "a refusal names its reason"


def test_the_whole_shipped_policy_passes_an_identical_candidate():
    sides = {name: SuiteOutcomes(name, "v1", _outcomes(name, _production_passes(name)), planned=None) for name in BASE}
    r = decide_gate(sides, sides, POLICY)
    assert r.decision == "pass", [x.message for x in r.failures()]
    assert r.suites["dataframebench"].check == "deterioration"
    assert r.suites["dataframebench"].power is None


def test_a_deterioration_check_fails_only_a_significantly_worse_candidate():
    """At production 6/100 on a deterioration suite: losing 1 pass passes (floor and monitors decide),
    losing all 6 fails (the interval lies wholly below 0)."""
    name = "mined"
    prod = _outcomes(name, set(range(0, 100, 17)))
    assert sum(o.passed for o in prod) == 6
    assert _decide(name, _outcomes(name, set(range(17, 100, 17))), prod).decision == "pass"
    r = _decide(name, _outcomes(name, set()), prod)
    assert r.decision == "fail" and {x.check for x in r.failures()} == {"deterioration"}

"""The gate's monitors (edit rate, clarifying questions, tokens, latency, invalid tool calls): their
values, bounds and drift intervals, and how often an unchanged checkpoint breaches them."""

from __future__ import annotations

import numpy as np
import pytest

from evals.gate.models import Outcome
from evals.gate.monitors import monitor_drift_interval, monitor_values
from evals.gate.policy import MonitorBound
from tests.unit.test_gate import config, decide, table


def test_monitor_breach_fails_even_when_pass_rate_is_better():
    cand, prod = table(b=40, c=0, both=60, neither=100)
    # The candidate stops editing on half the tasks and asks questions instead.
    cand = [
        Outcome(o.task_id, 0, o.passed, 100, 1.0, 4, 0, asked_question=i % 2 == 0, edited=i % 2 == 1)
        for i, o in enumerate(cand)
    ]
    cfg = config(
        monitors=[
            MonitorBound(metric="edit_rate", worse="decrease", abs_tolerance=0.05),
            MonitorBound(metric="clarifying_question_rate", abs_tolerance=0.05),
            MonitorBound(metric="mean_completion_tokens", rel_tolerance=0.25),
        ]
    )
    r = decide(cand, prod, cfg)
    assert not r.passed
    breached = {x.metric for x in r.failures() if x.check == "monitor"}
    assert breached == {"edit_rate", "clarifying_question_rate"}
    ok = [x for x in r.reasons if x.check == "monitor" and x.passed]
    assert [x.metric for x in ok] == ["mean_completion_tokens"]
    assert "BREACH" in next(x.message for x in r.failures() if x.metric == "edit_rate")


def test_monitor_relative_and_absolute_bounds():
    cand, prod = table(b=0, c=0, both=50, neither=50)
    slow = [
        Outcome(
            o.task_id, 0, o.passed, completion_tokens=140, latency_s=1.2, tool_calls=4, tool_call_errors=1, edited=True
        )
        for o in cand
    ]
    cfg = config(
        monitors=[
            MonitorBound(metric="mean_completion_tokens", rel_tolerance=0.25),
            MonitorBound(metric="mean_latency_s", rel_tolerance=0.1, abs_tolerance=0.5),
            MonitorBound(metric="invalid_tool_call_rate", abs_tolerance=0.5, limit=0.2),
        ]
    )
    r = decide(slow, prod, cfg)
    verdict = {x.metric: x.passed for x in r.reasons if x.check == "monitor"}
    # +40 % tokens > 25 %; +0.2 s latency < max(0.1 s, 0.5 s); error rate 0.25 over the 0.2 ceiling.
    assert verdict == {"mean_completion_tokens": False, "mean_latency_s": True, "invalid_tool_call_rate": False}


def test_monitor_values_units():
    outs = [
        Outcome(
            "a",
            0,
            True,
            completion_tokens=10,
            latency_s=1.0,
            tool_calls=4,
            tool_call_errors=1,
            asked_question=True,
            edited=False,
        ),
        Outcome("b", 0, False, completion_tokens=30, latency_s=3.0, tool_calls=0, edited=True),
    ]
    v = monitor_values(outs)
    assert v["invalid_tool_call_rate"] == 0.25 and v["clarifying_question_rate"] == 0.5
    assert v["edit_rate"] == 0.5 and v["mean_completion_tokens"] == 20 and v["mean_latency_s"] == 2.0


EDIT_RATE = MonitorBound(metric="edit_rate", worse="decrease", abs_tolerance=0.05)


def edits(cand_edited, prod_edited):
    """Paired outcomes (one task each, all passing) that differ only in whether the session edited."""
    return (
        [Outcome(f"t{i}", 0, True, edited=bool(e)) for i, e in enumerate(cand_edited)],
        [Outcome(f"t{i}", 0, True, edited=bool(e)) for i, e in enumerate(prod_edited)],
    )


def monitor_verdict(result, metric="edit_rate"):
    return next(x for x in result.reasons if x.check == "monitor" and x.metric == metric)


def test_a_monitor_on_few_pairs_does_not_breach_on_noise():
    # The demo's case: 4 pairs, the candidate edited in 2 sessions, production in 3 (-25 points).
    cand, prod = edits([1, 1, 0, 0], [1, 1, 1, 0])
    # The bootstrap and no power rule: the pass rates are identical, so the monitor alone decides.
    noisy = decide(cand, prod, config(monitors=[EDIT_RATE], method="bootstrap"))
    v = monitor_verdict(noisy)
    assert noisy.passed and v.passed, v.message
    assert v.details["drift"] == pytest.approx(0.25) and v.details["drift_low"] <= 0.05
    assert v.details["rule"] == "significant" and "lower bound" in v.message
    point = decide(cand, prod, config(monitors=[EDIT_RATE], monitor_rule="point", method="bootstrap"))
    assert not point.passed and monitor_verdict(point).details["rule"] == "point"


def test_a_monitor_breaches_on_a_regression_the_pairs_show():
    # 100 pairs: the candidate stopped editing in 30 sessions production edited in, started in 2.
    cand, prod = edits([0] * 30 + [1] * 2 + [1] * 60 + [0] * 8, [1] * 30 + [0] * 2 + [1] * 60 + [0] * 8)
    r = decide(cand, prod, config(monitors=[EDIT_RATE]))
    v = monitor_verdict(r)
    assert not r.passed and not v.passed and "BREACH" in v.message
    assert v.details["drift"] == pytest.approx(0.28) and 0.05 < v.details["drift_low"] < 0.28


@pytest.mark.parametrize(
    "rule, bound", [("significant", lambda rate: rate <= 0.05), ("point", lambda rate: rate >= 0.15)]
)
def test_an_unchanged_checkpoints_monitor_breaches_rarely(rule, bound, sims=200):
    """Both sides draw edits from the same distribution (40 pairs, each session edits with p = 0.6,
    the two sides agree on 60 % of sessions): the significant rule's false breaches stay under its
    5 % level (0 of 200 here), the point rule's do not (~20 %)."""
    rng = np.random.default_rng(11)
    cfg = config(monitors=[EDIT_RATE], monitor_rule=rule, bootstrap_resamples=500)
    breaches = 0
    for _ in range(sims):
        prod = rng.random(40) < 0.6
        cand = np.where(rng.random(40) < 0.6, prod, rng.random(40) < 0.6)
        breaches += not monitor_verdict(decide(*edits(cand, prod), cfg)).passed
    assert bound(breaches / sims), breaches / sims


def test_monitor_drift_interval_of_a_ratio_metric():
    # Every candidate session +10 tokens: the drift is exactly +10 in every replicate.
    prod = [Outcome(f"t{i % 5}", i // 5, True, completion_tokens=100 + i) for i in range(20)]
    cand = [Outcome(o.task_id, o.sample_index, True, completion_tokens=o.completion_tokens + 10) for o in prod]
    assert monitor_drift_interval("mean_completion_tokens", "increase", cand, prod) == pytest.approx((10.0, 10.0))
    assert monitor_drift_interval("mean_completion_tokens", "decrease", cand, prod) == pytest.approx((-10.0, -10.0))
    # A ratio of sums: tool-call errors / calls, 0 when no calls (production made none).
    cand = [Outcome("a", 0, True, tool_calls=4, tool_call_errors=2), Outcome("b", 0, True, tool_calls=4)]
    prod = [Outcome("a", 0, True), Outcome("b", 0, True)]
    low, high = monitor_drift_interval("invalid_tool_call_rate", "increase", cand, prod, resamples=2000)
    assert 0.0 <= low <= 0.25 <= high <= 0.5
    assert monitor_drift_interval("p90_latency_s", "increase", cand, prod) is None
    with pytest.raises(ValueError):
        monitor_drift_interval("edit_rate", "decrease", cand, prod[:1])

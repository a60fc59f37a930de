"""Behaviour monitors of the gate: statistics of sessions and their drift versus production.

Invariant: a monitor is computed on the same paired outcomes as the pass rate, and its drift
interval resamples tasks (clusters) exactly as :func:`app.core.intervals.paired_bootstrap_interval`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import get_args

import numpy as np

from app.core.intervals import _cluster_percentile_interval
from evals.gate.models import MonitorReport, Outcome
from evals.gate.policy import MonitorBound, MonitorName


def monitor_values(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Behaviour statistics of a set of outcomes.

    ``invalid_tool_call_rate`` = tool-call errors / tool calls (0 without calls);
    ``clarifying_question_rate`` and ``edit_rate`` are fractions of sessions;
    ``mean_completion_tokens`` in tokens; ``mean_latency_s`` and ``p90_latency_s`` in seconds;
    ``sandbox_denial_rate`` = fraction of sessions whose code tried something the sandbox refused
    (a read or write outside its folder, a connection): a candidate that learned to probe its box.
    """
    if not outcomes:
        return dict.fromkeys(get_args(MonitorName), 0.0)
    calls = sum(o.tool_calls for o in outcomes)
    lat = np.array([o.latency_s for o in outcomes], dtype=np.float64)
    n = len(outcomes)
    return {
        "invalid_tool_call_rate": sum(o.tool_call_errors for o in outcomes) / calls if calls else 0.0,
        "clarifying_question_rate": sum(o.asked_question for o in outcomes) / n,
        "edit_rate": sum(o.edited for o in outcomes) / n,
        "mean_completion_tokens": sum(o.completion_tokens for o in outcomes) / n,
        "mean_latency_s": float(lat.mean()),
        "p90_latency_s": float(np.quantile(lat, 0.9)),
        "sandbox_denial_rate": sum(o.sandbox_denials > 0 for o in outcomes) / n,
    }


_MONITOR_PARTS: dict[str, Callable[[Outcome], tuple[float, float]]] = {
    "invalid_tool_call_rate": lambda o: (o.tool_call_errors, o.tool_calls),
    "clarifying_question_rate": lambda o: (float(o.asked_question), 1.0),
    "edit_rate": lambda o: (float(o.edited), 1.0),
    "mean_completion_tokens": lambda o: (o.completion_tokens, 1.0),
    "mean_latency_s": lambda o: (o.latency_s, 1.0),
    "sandbox_denial_rate": lambda o: (float(o.sandbox_denials > 0), 1.0),
}
"""Each monitor that is a ratio of sums over sessions: an outcome's (numerator, denominator) share
(``p90_latency_s``, a quantile, is not one)."""


def monitor_drift_interval(
    metric: str,
    worse: str,
    candidate: Sequence[Outcome],
    production: Sequence[Outcome],
    *,
    confidence: float = 0.95,
    two_sided: bool = False,
    resamples: int = 10_000,
    seed: int | np.random.SeedSequence = 0,
) -> tuple[float, float] | None:
    """Percentile interval of a monitor's drift in the bad direction over paired outcomes,
    resampling tasks (clusters) as :func:`paired_bootstrap_interval` does.

    The monitor is a ratio of sums (``sum(numerator) / sum(denominator)``, 0 when the denominator
    is 0, as in :func:`monitor_values`), computed on both sides of every replicate; the drift is
    ``candidate - production`` (``worse = "increase"``) or its negative, in the metric's unit.
    Efron & Tibshirani (1993) ch. 13 (percentile interval); Davison & Hinkley (1997) §3.8 (clusters).

    Args:
        candidate, production: ``[n]`` outcomes, paired by position (same task and sample).

    Returns:
        ``(low, high)``; None for a metric that is not a ratio of sums (``p90_latency_s``) or no pairs.

    Raises:
        ValueError: the sides differ in length.
    """
    if len(candidate) != len(production):
        raise ValueError("candidate and production outcomes must be paired")
    part = _MONITOR_PARTS.get(metric)
    if part is None or not candidate:
        return None
    index: dict[str, int] = {}
    sums = np.zeros((len({o.task_id for o in candidate}), 4))  # [tasks, (cand num, cand den, prod num, prod den)]
    for c, p in zip(candidate, production):
        row = sums[index.setdefault(c.task_id, len(index))]
        row[0:2] += part(c)
        row[2:4] += part(p)
    if np.array_equal(sums[:, 0:2], sums[:, 2:4]):  # the same on every task: every replicate is exactly 0
        return 0.0, 0.0
    sign = 1.0 if worse == "increase" else -1.0

    def drift(tot: np.ndarray) -> np.ndarray:
        with np.errstate(invalid="ignore", divide="ignore"):
            c_val = np.where(tot[:, 1] > 0, tot[:, 0] / tot[:, 1], 0.0)
            p_val = np.where(tot[:, 3] > 0, tot[:, 2] / tot[:, 3], 0.0)
        drifted: np.ndarray = sign * (c_val - p_val)
        return drifted

    return _cluster_percentile_interval(
        sums, drift, confidence=confidence, two_sided=two_sided, resamples=resamples, seed=seed
    )


def check_monitor(
    bound: MonitorBound, candidate: float, production: float, interval: tuple[float, float] | None = None
) -> MonitorReport:
    """Apply one monitor bound (see :class:`evals.gate.policy.MonitorBound`).

    Args:
        candidate, production: the metric's values (:func:`monitor_values`).
        interval: the drift's confidence interval (:func:`monitor_drift_interval`): given, the
            monitor breaches only if its low end is above the allowed drift (the ``significant``
            rule); None, if the observed drift is (the ``point`` rule). ``limit`` always bounds the
            candidate's observed value.
    """
    drift = candidate - production if bound.worse == "increase" else production - candidate
    allowances = [
        a
        for a in (bound.abs_tolerance, None if bound.rel_tolerance is None else bound.rel_tolerance * abs(production))
        if a is not None
    ]
    allowed = max(allowances) if allowances else None
    decisive = drift if interval is None else interval[0]
    ok = allowed is None or decisive <= allowed + 1e-12
    if bound.limit is not None:
        ok = ok and (candidate <= bound.limit if bound.worse == "increase" else candidate >= bound.limit)
    low, high = interval if interval is not None else (None, None)
    return MonitorReport(
        metric=bound.metric,
        candidate=candidate,
        production=production,
        allowed_drift=allowed,
        limit=bound.limit,
        worse=bound.worse,
        passed=ok,
        drift=drift,
        drift_low=low,
        drift_high=high,
        rule="point" if interval is None else "significant",
    )

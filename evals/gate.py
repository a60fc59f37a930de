"""The promotion gate: a pure decision over paired eval outcomes (no DB, no IO).

Invariant: the gate fails closed and knows what it cannot know. Each suite ends ``pass``,
``fail`` or ``insufficient_evidence``. A suite passes only if it has complete, paired results
(same suite version, same (task, sample) keys on both sides) and, on those pairs, (1) the lower
confidence bound of the pass-rate difference candidate - production is above ``-tolerance``
(non-inferiority), (2) the gate had the power to make that check mean something: at the observed
pairs and production's rate, an equal candidate clears the margin with probability at least
``min_power`` (:mod:`evals.power`), (3) the candidate's pass rate meets the suite's absolute floor,
and (4) no behaviour monitor breaches its bound versus production (by default: the confidence
interval of its drift lies beyond the allowance, see ``GateConfig.monitor_rule``). Missing,
unpaired or errored results, a breached floor or monitor, and a difference the interval puts below
0 (or below the margin on a suite with the power) fail. Too few pairs, or too little power, with no
such failure, are ``insufficient_evidence``: not a pass, and not promotable without a release
manager's written override (``app.promotion.service``).

The interval (``GateConfig.method``, default ``newcombe``) is Newcombe's paired score interval,
which keeps its coverage at small n and rates near 0 or 1 (0/4 vs 0/4: about +-40 points, where the
bootstrap gives zero width). With ``k`` samples per task every sample pairs with production's
sample of the same index, and the gate takes the wider of that interval and the task-clustered
bootstrap (:func:`app.core.intervals.paired_bootstrap_interval`, which resamples tasks with all
their samples, so more samples narrow it). The data models live in :mod:`evals.gate_models`, the
intervals in :mod:`app.core.intervals`, the power in :mod:`evals.power`, the monitors in
:mod:`evals.monitors`, pass@k in :mod:`evals.passk`; they are re-exported here.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from app.core.intervals import (
    mcnemar_exact_interval,
    newcombe_paired_interval,
    paired_bootstrap_interval,
    wilson_interval,
)
from evals.config import GateConfig
from evals.gate_models import (
    Decision,
    GateReason,
    GateResult,
    Key,
    MonitorReport,
    Outcome,
    PassRate,
    SamplingReport,
    SuiteOutcomes,
    SuiteReport,
)
from evals.monitors import check_monitor, monitor_drift_interval, monitor_values
from evals.passk import pass_at_k, sampling_report, task_counts
from evals.power import non_inferiority_power

__all__ = [
    "Decision",
    "GateReason",
    "GateResult",
    "Key",
    "MonitorReport",
    "Outcome",
    "PassRate",
    "SamplingReport",
    "SuiteOutcomes",
    "SuiteReport",
    "check_monitor",
    "decide_gate",
    "mcnemar_exact_interval",
    "monitor_drift_interval",
    "newcombe_paired_interval",
    "non_inferiority_power",
    "monitor_values",
    "paired_bootstrap_interval",
    "pass_at_k",
    "sampling_report",
]


def _task_solved(outcomes: Sequence[Outcome]) -> dict[str, bool]:
    """Task solved = at least half of its samples passed (majority over samples)."""
    per: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        per[o.task_id].append(o.passed)
    return {t: 2 * sum(v) >= len(v) for t, v in per.items()}


def _fmt_keys(keys: set[Key], limit: int = 5) -> str:
    shown = ", ".join(f"{t}#{i}" for t, i in sorted(keys)[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _difference_interval(
    name: str,
    keys: list[Key],
    c_out: list[Outcome],
    p_out: list[Outcome],
    table: tuple[int, int, int, int],
    k_per_task: int,
    config: GateConfig,
) -> tuple[float, float]:
    """The interval of candidate - production under ``config.method``; ``table`` is the paired
    2x2 table (both passed, candidate only, production only, neither)."""
    if config.method == "mcnemar":
        _, b, c, _ = table
        return mcnemar_exact_interval(b, c, len(keys), confidence=config.confidence, two_sided=config.two_sided)
    score = newcombe_paired_interval(*table, confidence=config.confidence, two_sided=config.two_sided)
    if config.method == "newcombe" and k_per_task == 1:
        return score
    boot = paired_bootstrap_interval(
        [k[0] for k in keys],
        [int(x.passed) - int(y.passed) for x, y in zip(c_out, p_out)],
        confidence=config.confidence,
        two_sided=config.two_sided,
        resamples=config.bootstrap_resamples,
        seed=np.random.SeedSequence([config.seed, zlib.crc32(name.encode())]),
    )
    if config.method == "bootstrap":
        return boot
    return min(score[0], boot[0]), max(score[1], boot[1])


def _suite_decision(report: SuiteReport, reasons: list[GateReason]) -> Decision:
    """``fail`` when a check failed outright, else ``insufficient_evidence`` when one could not
    decide (or nothing paired), else ``pass``."""
    if any(not r.passed and not r.inconclusive for r in reasons):
        return "fail"
    if any(not r.passed for r in reasons) or (
        report.n_pairs == 0 and not any(r.check == "empty_suite" for r in reasons)
    ):
        return "insufficient_evidence"
    return "pass"


def _evaluate_suite(
    name: str, gated: bool, cand: SuiteOutcomes | None, prod: SuiteOutcomes | None, config: GateConfig
) -> tuple[SuiteReport, list[GateReason]]:
    """Every check of one suite on its paired outcomes. All samples of a task pair by
    ``(task, sample_index)`` and enter the interval together (task-clustered); the difference is
    the mean over tasks of each task's mean paired difference (= the difference of pass@1)."""
    sg = config.for_suite(name)
    method = config.method
    reasons: list[GateReason] = []

    def reason(check: str, passed: bool, message: str, **kw: Any) -> None:
        reasons.append(GateReason(check=check, suite=name, gated=gated, passed=passed, message=message, **kw))

    if cand is None or prod is None:
        missing = [who for who, x in (("candidate", cand), ("production", prod)) if x is None]
        reason("missing_suite", False, f"{name}: no results for {' and '.join(missing)}", details={"missing": missing})
        return SuiteReport(
            suite=name, gated=gated, suite_version=None, passed=False, n_pairs=0, n_tasks=0, method=method
        ), reasons
    if cand.suite_version != prod.suite_version:
        reason(
            "version_mismatch",
            False,
            f"{name}: candidate ran suite version {cand.suite_version}, production {prod.suite_version}",
            details={"candidate": cand.suite_version, "production": prod.suite_version},
        )
    c_by = {o.key: o for o in cand.outcomes}
    p_by = {o.key: o for o in prod.outcomes}
    for who, side, by in (("candidate", cand, c_by), ("production", prod, p_by)):
        if side.planned is not None and (missing := set(side.planned) - set(by)):
            reason(
                "missing_results",
                False,
                f"{name}: {who} lacks {len(missing)} planned results: {_fmt_keys(missing)}",
                details={"side": who, "missing": len(missing)},
            )
    unpaired = set(c_by) ^ set(p_by)
    if unpaired:
        reason(
            "unpaired",
            False,
            f"{name}: {len(unpaired)} (task, sample) outcomes without a partner: {_fmt_keys(unpaired)}",
            details={"unpaired": len(unpaired)},
        )
    keys = sorted(set(c_by) & set(p_by))
    n = len(keys)
    c_out = [c_by[k] for k in keys]
    p_out = [p_by[k] for k in keys]
    errored = sum(o.error is not None for o in c_out + p_out)
    if n and errored / (2 * n) > config.max_error_fraction:
        reason(
            "errors",
            False,
            f"{name}: {errored} of {2 * n} sessions errored (allowed fraction {config.max_error_fraction:.2f})",
            value=errored / (2 * n),
            bound=config.max_error_fraction,
        )
    if n == 0 and not c_by and not p_by and not unpaired and sg.allow_empty and not reasons:
        reason("empty_suite", True, f"{name}: the suite holds no task on either side (allowed for this suite)")
        return SuiteReport(
            suite=name, gated=gated, suite_version=cand.suite_version, passed=True, n_pairs=0, n_tasks=0, method=method
        ), reasons
    if n < (sg.min_pairs or 1):
        reason(
            "too_few_pairs",
            False,
            f"{name}: {n} paired outcomes, need at least {sg.min_pairs}: insufficient evidence",
            value=float(n),
            bound=float(sg.min_pairs or 1),
            inconclusive=True,
        )
    report = SuiteReport(
        suite=name,
        gated=gated,
        suite_version=cand.suite_version,
        passed=False,
        n_pairs=n,
        n_tasks=len({k[0] for k in keys}),
        method=method,
    )
    if n == 0:
        return report, reasons

    kc = sum(o.passed for o in c_out)
    kp = sum(o.passed for o in p_out)
    b = sum(x.passed and not y.passed for x, y in zip(c_out, p_out))
    c = sum(y.passed and not x.passed for x, y in zip(c_out, p_out))
    both = sum(x.passed and y.passed for x, y in zip(c_out, p_out))
    c_samp, p_samp = sampling_report(c_out), sampling_report(p_out)
    diff = c_samp.pass_at_k["1"] - p_samp.pass_at_k["1"]  # mean over tasks of each task's mean difference
    k_per_task = max(n_ for n_, _ in task_counts(c_out).values())
    lo, hi = _difference_interval(name, keys, c_out, p_out, (both, b, c, n - both - b - c), k_per_task, config)
    tol = sg.tolerance or 0.0
    side = "two-sided" if config.two_sided else "one-sided"
    power = non_inferiority_power(
        n,
        kp / n,
        tol,
        confidence=config.confidence,
        two_sided=config.two_sided,
        sims=config.power_sims,
        seed=config.seed,
    )
    powered = power >= config.min_power
    reason(
        "power",
        powered,
        f"{name}: power {power:.2f} to tell an equal candidate from one {tol:.1%} worse at {n} pairs and "
        f"production's {kp / n:.1%} (needs {config.min_power:.2f})"
        + ("" if powered else ": insufficient evidence for a pass"),
        metric="power",
        value=power,
        bound=config.min_power,
        details={"n": n, "base_rate": kp / n, "margin": tol, "sims": config.power_sims},
        inconclusive=True,
    )
    ni_ok = lo > -tol
    # A failed check is a clear fail when the interval lies below 0 (the candidate is worse) or the
    # suite had the power for its margin; otherwise the pairs cannot tell.
    ni_clear = ni_ok or hi < 0 or powered
    verdict = "" if ni_clear else "; the interval also holds 0: insufficient evidence"
    how = "newcombe or clustered bootstrap, the wider" if method == "newcombe" and k_per_task > 1 else method
    reason(
        "non_inferiority",
        ni_ok,
        f"{name}: candidate {kc}/{n} vs production {kp}/{n} ({report.n_tasks} tasks x {k_per_task} "
        f"sample{'s' if k_per_task > 1 else ''}, paired and clustered by task), difference {diff:+.1%} "
        f"({config.confidence:.0%} {side} {how} interval [{lo:+.1%}, {hi:+.1%}], lower bound "
        f"{'>' if ni_ok else '<='} -{tol:.1%}); {b} newly passed, {c} newly failed pairs{verdict}",
        metric="pass_rate_diff_lower_bound",
        value=lo,
        bound=-tol,
        details={
            "diff": diff,
            "low": lo,
            "high": hi,
            "candidate_only": b,
            "production_only": c,
            "method": method,
            "confidence": config.confidence,
            "two_sided": config.two_sided,
        },
        inconclusive=not ni_clear,
    )
    c_rate = kc / n
    reason(
        "floor",
        c_rate >= sg.floor,
        f"{name}: candidate pass rate {c_rate:.1%} "
        f"{'meets' if c_rate >= sg.floor else 'is below'} the floor {sg.floor:.1%}",
        metric="pass_rate",
        value=c_rate,
        bound=sg.floor,
    )
    cv, pv = monitor_values(c_out), monitor_values(p_out)
    monitors = []
    for bound in config.monitors:
        interval = (
            None
            if config.monitor_rule == "point"
            else monitor_drift_interval(
                bound.metric,
                bound.worse,
                c_out,
                p_out,
                confidence=config.confidence,
                two_sided=config.two_sided,
                resamples=config.bootstrap_resamples,
                seed=np.random.SeedSequence(
                    [config.seed, zlib.crc32(name.encode()), zlib.crc32(bound.metric.encode())]
                ),
            )
        )
        m = check_monitor(bound, cv[bound.metric], pv[bound.metric], interval)
        monitors.append(m)
        allowed = "" if m.allowed_drift is None else f", allowed {m.allowed_drift:.4g}"
        lim = "" if m.limit is None else f", limit {m.limit:.4g}"
        bound_text = "" if m.drift_low is None else f" ({config.confidence:.0%} {side} lower bound {m.drift_low:+.4g})"
        reason(
            "monitor",
            m.passed,
            f"{name}: {m.metric} {m.candidate:.4g} vs production {m.production:.4g}: "
            f"drift toward {m.worse} {m.drift:+.4g}{bound_text}{allowed}{lim} -> {'ok' if m.passed else 'BREACH'}",
            metric=m.metric,
            value=m.candidate,
            bound=m.limit,
            details=m.model_dump(),
        )

    cs, ps = _task_solved(c_out), _task_solved(p_out)
    report = report.model_copy(
        update=dict(
            candidate=PassRate(
                rate=c_rate, n=n, **dict(zip(("low", "high"), wilson_interval(kc, n, config.confidence)))
            ),
            production=PassRate(
                rate=kp / n, n=n, **dict(zip(("low", "high"), wilson_interval(kp, n, config.confidence)))
            ),
            diff=diff,
            diff_low=lo,
            diff_high=hi,
            power=power,
            margin=tol,
            candidate_only=b,
            production_only=c,
            monitors=monitors,
            newly_solved=sorted(t for t in cs if cs[t] and not ps[t]),
            newly_broken=sorted(t for t in cs if ps[t] and not cs[t]),
            samples_per_task=k_per_task,
            candidate_sampling=c_samp,
            production_sampling=p_samp,
        )
    )
    return report, reasons


def decide_gate(
    candidate: Mapping[str, SuiteOutcomes], production: Mapping[str, SuiteOutcomes], config: GateConfig
) -> GateResult:
    """Decide whether ``candidate`` may be promoted over ``production``.

    Args:
        candidate: the candidate's outcomes by suite name.
        production: production's outcomes by suite name (same suite versions expected).
        config: the gate policy.

    Returns:
        A :class:`GateResult`: ``decision`` is ``fail`` when no suite is gated or a gated suite
        failed, else ``insufficient_evidence`` when a gated suite could not decide, else ``pass``
        (``passed``). Ungated suites present on both sides are reported, never decisive.
    """
    gated = config.gated_suites()
    names = sorted(set(gated) | (set(candidate) & set(production)))
    reasons: list[GateReason] = []
    suites: dict[str, SuiteReport] = {}
    if not gated:
        reasons.append(
            GateReason(
                check="no_gated_suites", passed=False, message="the gate config names no gated suite; refusing to pass"
            )
        )
    for name in names:
        is_gated = name in gated
        report, rs = _evaluate_suite(name, is_gated, candidate.get(name), production.get(name), config)
        decision = _suite_decision(report, rs)
        suites[name] = report.model_copy(update={"passed": decision == "pass", "decision": decision})
        reasons.extend(rs)
    decisions = {suites[s].decision for s in gated}
    overall: Decision = (
        "fail"
        if not gated or "fail" in decisions
        else "insufficient_evidence"
        if "insufficient_evidence" in decisions
        else "pass"
    )
    return GateResult(
        passed=overall == "pass",
        decision=overall,
        reasons=reasons,
        suites=suites,
        config=config.model_dump(mode="json"),
    )

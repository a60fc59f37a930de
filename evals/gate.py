"""The promotion gate: a pure decision over paired eval outcomes (no DB, no IO).

Invariant: the gate fails closed. A candidate passes only if every gated suite has complete,
paired results (same suite version, same (task, sample) keys on both sides) and, on those pairs,
(1) the lower confidence bound of the pass-rate difference candidate - production is above
``-tolerance`` (non-inferiority), (2) the candidate's pass rate meets the suite's absolute floor,
and (3) no behaviour monitor breaches its bound versus production (by default: the confidence
interval of its drift lies beyond the allowance, see ``GateConfig.monitor_rule``). Anything missing,
unpaired or errored beyond the allowance is a failure with a reason, never a silent skip.

With ``k`` samples per task every sample pairs with production's sample of the same index and the
interval resamples tasks with all their samples (:func:`app.core.intervals.paired_bootstrap_interval`),
so more samples narrow it. The data models live in :mod:`evals.gate_models`, the intervals in
:mod:`app.core.intervals`, the monitors in :mod:`evals.monitors`, pass@k in :mod:`evals.passk`; they are
re-exported here.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from app.core.intervals import mcnemar_exact_interval, paired_bootstrap_interval, wilson_interval
from evals.config import GateConfig
from evals.gate_models import (
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

__all__ = [
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
            f"{name}: {n} paired outcomes, need at least {sg.min_pairs}",
            value=float(n),
            bound=float(sg.min_pairs or 1),
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
    c_samp, p_samp = sampling_report(c_out), sampling_report(p_out)
    diff = c_samp.pass_at_k["1"] - p_samp.pass_at_k["1"]  # mean over tasks of each task's mean difference
    k_per_task = max(n_ for n_, _ in task_counts(c_out).values())
    if method == "bootstrap":
        seed = np.random.SeedSequence([config.seed, zlib.crc32(name.encode())])
        lo, hi = paired_bootstrap_interval(
            [k[0] for k in keys],
            [int(x.passed) - int(y.passed) for x, y in zip(c_out, p_out)],
            confidence=config.confidence,
            two_sided=config.two_sided,
            resamples=config.bootstrap_resamples,
            seed=seed,
        )
    else:
        lo, hi = mcnemar_exact_interval(b, c, n, confidence=config.confidence, two_sided=config.two_sided)
    tol = sg.tolerance or 0.0
    side = "two-sided" if config.two_sided else "one-sided"
    ni_ok = lo > -tol
    reason(
        "non_inferiority",
        ni_ok,
        f"{name}: candidate {kc}/{n} vs production {kp}/{n} ({report.n_tasks} tasks x {k_per_task} "
        f"sample{'s' if k_per_task > 1 else ''}, paired and clustered by task), difference {diff:+.1%} "
        f"({config.confidence:.0%} {side} {method} lower bound {lo:+.1%} "
        f"{'>' if ni_ok else '<='} -{tol:.1%}); {b} newly passed, {c} newly failed pairs",
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
        A :class:`GateResult`; ``passed`` only if every gated suite passes every check and at least
        one suite is gated. Ungated suites present on both sides are reported, never decisive.
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
        ok = all(r.passed for r in rs) and (report.n_pairs > 0 or any(r.check == "empty_suite" for r in rs))
        report = report.model_copy(update={"passed": ok})
        suites[name] = report
        reasons.extend(rs)
    passed = bool(gated) and all(r.passed for r in reasons if r.gated) and all(suites[s].passed for s in gated)
    return GateResult(passed=passed, reasons=reasons, suites=suites, config=config.model_dump(mode="json"))

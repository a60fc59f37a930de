"""The promotion gate: a pure decision over paired eval outcomes (no DB, no IO).

Invariant: the gate fails closed. A candidate passes only if every gated suite has complete,
paired results (same suite version, same (task, sample) keys on both sides) and, on those pairs,
(1) the lower confidence bound of the pass-rate difference candidate - production is above
``-tolerance`` (non-inferiority), (2) the candidate's pass rate meets the suite's absolute floor,
and (3) no behaviour monitor breaches its bound versus production (by default: the confidence
interval of its drift lies beyond the allowance, see ``GateConfig.monitor_rule``). Anything missing,
unpaired or errored beyond the allowance is a failure with a reason, never a silent skip.

Intervals:
- *Paired bootstrap* (default): percentile interval of the mean paired difference, resampling
  tasks with replacement (a cluster bootstrap, so the samples of one task move together).
  Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 6 and 13 (percentile
  interval); Davison & Hinkley (1997) §3.8 for resampling clusters.
- *Exact McNemar*: conditional on the ``n_d = b + c`` discordant pairs, ``b ~ Binomial(n_d, p)``
  (McNemar 1947, *Psychometrika* 12:153); a Clopper-Pearson (1934) interval for ``p`` maps to the
  difference ``(b - c) / n = (n_d / n)(2p - 1)``. It treats every (task, sample) pair as independent.
- Per-checkpoint pass rates are shown with Wilson (1927) score intervals.
"""

from __future__ import annotations

import math
import zlib
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from pydantic import BaseModel, Field
from scipy import stats

from evals.config import GateConfig, MonitorBound

Key = tuple[str, int]


@dataclass(frozen=True)
class Outcome:
    """One sample of one task in an eval run (an ``eval_result`` row, detached from the DB)."""

    task_id: str
    sample_index: int
    passed: bool
    completion_tokens: int = 0
    latency_s: float = 0.0
    tool_calls: int = 0
    tool_call_errors: int = 0
    asked_question: bool = False
    edited: bool = False
    error: str | None = None

    @property
    def key(self) -> Key:
        return (self.task_id, self.sample_index)


@dataclass(frozen=True)
class SuiteOutcomes:
    """A checkpoint's outcomes on one suite. ``planned`` are the keys the run set out to produce
    (None: whatever is in ``outcomes`` was the plan)."""

    suite: str
    suite_version: str
    outcomes: Sequence[Outcome]
    planned: Sequence[Key] | None = None
    run_id: str | None = None
    checkpoint_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


class GateReason(BaseModel):
    """One check's verdict: human-readable ``message`` plus machine fields."""

    check: str = Field(description="missing_suite | version_mismatch | missing_results | unpaired | errors | "
                                   "too_few_pairs | non_inferiority | floor | monitor | empty_suite | no_gated_suites")
    suite: str | None = None
    gated: bool = True
    passed: bool
    message: str
    metric: str | None = None
    value: float | None = None
    bound: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)


class PassRate(BaseModel):
    """A pass rate over ``n`` outcomes with a two-sided Wilson score interval."""

    rate: float
    low: float
    high: float
    n: int


class MonitorReport(BaseModel):
    """One behaviour statistic, candidate vs production, and its bound.

    ``drift`` is the observed change in the bad direction (production - candidate when ``worse`` is
    ``decrease``), in the metric's unit; ``drift_low``/``drift_high`` its confidence interval (None
    under the point rule, or for ``p90_latency_s``); ``rule`` the comparison that decided (see
    :attr:`evals.config.GateConfig.monitor_rule`)."""

    metric: str
    candidate: float
    production: float
    allowed_drift: float | None
    limit: float | None
    worse: str
    passed: bool
    drift: float = 0.0
    drift_low: float | None = None
    drift_high: float | None = None
    rule: str = "point"


class SuiteReport(BaseModel):
    """Statistics of one suite on the paired outcomes."""

    suite: str
    gated: bool
    suite_version: str | None
    passed: bool
    n_pairs: int
    n_tasks: int
    candidate: PassRate | None = None
    production: PassRate | None = None
    diff: float | None = None
    diff_low: float | None = None
    diff_high: float | None = None
    method: str
    candidate_only: int = 0
    production_only: int = 0
    monitors: list[MonitorReport] = Field(default_factory=list)
    newly_solved: list[str] = Field(default_factory=list)
    newly_broken: list[str] = Field(default_factory=list)


class GateResult(BaseModel):
    """The gate's decision with every reason (passing and failing) and per-suite statistics."""

    passed: bool
    reasons: list[GateReason]
    suites: dict[str, SuiteReport]
    config: dict[str, Any]

    def failures(self) -> list[GateReason]:
        """The reasons that failed a gated suite (empty when ``passed``)."""
        return [r for r in self.reasons if not r.passed and r.gated]


# ---- intervals -----------------------------------------------------------------------------------

def _tail(confidence: float, two_sided: bool) -> float:
    return (1.0 - confidence) / 2.0 if two_sided else 1.0 - confidence


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson (1927) score interval of a binomial proportion ``k / n``; (0, 1) if n = 0."""
    if n == 0:
        return 0.0, 1.0
    z = float(stats.norm.ppf(1 - (1 - confidence) / 2))
    p = k / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def paired_bootstrap_interval(task_ids: Sequence[str], diffs: Sequence[float], *, confidence: float = 0.95,
                              two_sided: bool = False, resamples: int = 10_000,
                              seed: int | np.random.SeedSequence = 0) -> tuple[float, float]:
    """Percentile interval of the mean paired difference, resampling tasks (clusters).

    Args:
        task_ids: ``[n]`` task of each pair; pairs of one task are resampled together.
        diffs: ``[n]`` candidate minus production outcome per pair (-1, 0 or 1).
        confidence: confidence level; each returned bound is the ``tail`` quantile where ``tail``
            is ``1 - confidence`` (one-sided) or half of it (two-sided).
        resamples: bootstrap replicates B.
        seed: seed of the generator (same inputs and seed, same interval).

    Returns:
        ``(low, high)`` of the mean difference (Efron & Tibshirani 1993, percentile method).

    Raises:
        ValueError: no pairs, or lengths differ.
    """
    if len(task_ids) != len(diffs) or not diffs:
        raise ValueError("need one task id per difference and at least one pair")
    sums: dict[str, float] = defaultdict(float)
    counts: dict[str, int] = defaultdict(int)
    for t, d in zip(task_ids, diffs):
        sums[t] += float(d)
        counts[t] += 1
    per_task = np.array([(sums[t], counts[t]) for t in sums], dtype=np.float64)  # [tasks, (sum, pairs)]
    if not per_task[:, 0].any():  # no discordant pair anywhere: every replicate is exactly 0
        return 0.0, 0.0
    return _cluster_percentile_interval(per_task, lambda tot: tot[:, 0] / tot[:, 1], confidence=confidence,
                                        two_sided=two_sided, resamples=resamples, seed=seed)


def _cluster_percentile_interval(per_task: np.ndarray, statistic: Callable[[np.ndarray], np.ndarray], *,
                                 confidence: float, two_sided: bool, resamples: int,
                                 seed: int | np.random.SeedSequence) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over a task-cluster bootstrap: each replicate draws the
    tasks with replacement (multinomial weights) and totals their rows of ``per_task`` (``[tasks, k]``
    per-task sums); ``statistic`` maps replicate totals ``[B, k]`` to ``[B]`` values."""
    rng = np.random.default_rng(seed)
    n_tasks = len(per_task)
    out = np.empty(resamples)
    chunk = max(1, 4_000_000 // n_tasks)  # bound memory of the B x T count matrix
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        w = rng.multinomial(n_tasks, np.full(n_tasks, 1.0 / n_tasks), size=b).astype(np.float64)
        out[start:start + b] = statistic(w @ per_task)
    tail = _tail(confidence, two_sided)
    low, high = np.quantile(out, [tail, 1 - tail])
    return float(low) + 0.0, float(high) + 0.0  # + 0.0: no "-0" in messages


def mcnemar_exact_interval(b: int, c: int, n: int, *, confidence: float = 0.95,
                           two_sided: bool = False) -> tuple[float, float]:
    """Exact conditional interval of the paired difference from discordant counts.

    Args:
        b: pairs the candidate passed and production failed.
        c: pairs production passed and the candidate failed.
        n: all pairs (concordant included).

    Returns:
        ``(low, high)`` of ``(b - c) / n``: a Clopper-Pearson interval for ``p = b / (b + c)``
        mapped through ``(b + c) / n * (2p - 1)`` (McNemar 1947). ``(0, 0)`` when ``b + c = 0``.

    Raises:
        ValueError: ``n`` smaller than ``b + c`` or not positive.
    """
    if n <= 0 or b + c > n or b < 0 or c < 0:
        raise ValueError(f"invalid counts b={b} c={c} n={n}")
    nd = b + c
    if nd == 0:
        return 0.0, 0.0
    tail = _tail(confidence, two_sided)
    p_lo = 0.0 if b == 0 else float(stats.beta.ppf(tail, b, nd - b + 1))
    p_hi = 1.0 if b == nd else float(stats.beta.ppf(1 - tail, b + 1, nd - b))
    scale = nd / n
    return scale * (2 * p_lo - 1), scale * (2 * p_hi - 1)


# ---- monitors ------------------------------------------------------------------------------------

def monitor_values(outcomes: Sequence[Outcome]) -> dict[str, float]:
    """Behaviour statistics of a set of outcomes.

    ``invalid_tool_call_rate`` = tool-call errors / tool calls (0 without calls);
    ``clarifying_question_rate`` and ``edit_rate`` are fractions of sessions;
    ``mean_completion_tokens`` in tokens; ``mean_latency_s`` and ``p90_latency_s`` in seconds.
    """
    if not outcomes:
        return {k: 0.0 for k in ("invalid_tool_call_rate", "clarifying_question_rate", "edit_rate",
                                 "mean_completion_tokens", "mean_latency_s", "p90_latency_s")}
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
    }


_MONITOR_PARTS: dict[str, Callable[[Outcome], tuple[float, float]]] = {
    "invalid_tool_call_rate": lambda o: (o.tool_call_errors, o.tool_calls),
    "clarifying_question_rate": lambda o: (float(o.asked_question), 1.0),
    "edit_rate": lambda o: (float(o.edited), 1.0),
    "mean_completion_tokens": lambda o: (o.completion_tokens, 1.0),
    "mean_latency_s": lambda o: (o.latency_s, 1.0),
}
"""Each monitor that is a ratio of sums over sessions: an outcome's (numerator, denominator) share
(``p90_latency_s``, a quantile, is not one)."""


def monitor_drift_interval(metric: str, worse: str, candidate: Sequence[Outcome], production: Sequence[Outcome], *,
                           confidence: float = 0.95, two_sided: bool = False, resamples: int = 10_000,
                           seed: int | np.random.SeedSequence = 0) -> tuple[float, float] | None:
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
        return sign * (c_val - p_val)

    return _cluster_percentile_interval(sums, drift, confidence=confidence, two_sided=two_sided,
                                        resamples=resamples, seed=seed)


def check_monitor(bound: MonitorBound, candidate: float, production: float,
                  interval: tuple[float, float] | None = None) -> MonitorReport:
    """Apply one monitor bound (see :class:`evals.config.MonitorBound`).

    Args:
        candidate, production: the metric's values (:func:`monitor_values`).
        interval: the drift's confidence interval (:func:`monitor_drift_interval`): given, the
            monitor breaches only if its low end is above the allowed drift (the ``significant``
            rule); None, if the observed drift is (the ``point`` rule). ``limit`` always bounds the
            candidate's observed value.
    """
    drift = candidate - production if bound.worse == "increase" else production - candidate
    allowances = [a for a in (bound.abs_tolerance,
                              None if bound.rel_tolerance is None else bound.rel_tolerance * abs(production))
                  if a is not None]
    allowed = max(allowances) if allowances else None
    decisive = drift if interval is None else interval[0]
    ok = allowed is None or decisive <= allowed + 1e-12
    if bound.limit is not None:
        ok = ok and (candidate <= bound.limit if bound.worse == "increase" else candidate >= bound.limit)
    low, high = interval if interval is not None else (None, None)
    return MonitorReport(metric=bound.metric, candidate=candidate, production=production, allowed_drift=allowed,
                         limit=bound.limit, worse=bound.worse, passed=ok, drift=drift, drift_low=low,
                         drift_high=high, rule="point" if interval is None else "significant")


# ---- the decision --------------------------------------------------------------------------------

def _task_solved(outcomes: Sequence[Outcome]) -> dict[str, bool]:
    """Task solved = at least half of its samples passed (majority over samples)."""
    per: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        per[o.task_id].append(o.passed)
    return {t: 2 * sum(v) >= len(v) for t, v in per.items()}


def _fmt_keys(keys: set[Key], limit: int = 5) -> str:
    shown = ", ".join(f"{t}#{i}" for t, i in sorted(keys)[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def _evaluate_suite(name: str, gated: bool, cand: SuiteOutcomes | None, prod: SuiteOutcomes | None,
                    config: GateConfig) -> tuple[SuiteReport, list[GateReason]]:
    sg = config.for_suite(name)
    method = config.method
    reasons: list[GateReason] = []

    def reason(check: str, passed: bool, message: str, **kw: Any) -> None:
        reasons.append(GateReason(check=check, suite=name, gated=gated, passed=passed, message=message, **kw))

    if cand is None or prod is None:
        missing = [who for who, x in (("candidate", cand), ("production", prod)) if x is None]
        reason("missing_suite", False, f"{name}: no results for {' and '.join(missing)}",
               details={"missing": missing})
        return SuiteReport(suite=name, gated=gated, suite_version=None, passed=False, n_pairs=0, n_tasks=0,
                           method=method), reasons
    if cand.suite_version != prod.suite_version:
        reason("version_mismatch", False,
               f"{name}: candidate ran suite version {cand.suite_version}, production {prod.suite_version}",
               details={"candidate": cand.suite_version, "production": prod.suite_version})
    c_by = {o.key: o for o in cand.outcomes}
    p_by = {o.key: o for o in prod.outcomes}
    for who, side, by in (("candidate", cand, c_by), ("production", prod, p_by)):
        if side.planned is not None and (missing := set(side.planned) - set(by)):
            reason("missing_results", False, f"{name}: {who} lacks {len(missing)} planned results: "
                   f"{_fmt_keys(missing)}", details={"side": who, "missing": len(missing)})
    unpaired = set(c_by) ^ set(p_by)
    if unpaired:
        reason("unpaired", False, f"{name}: {len(unpaired)} (task, sample) outcomes without a partner: "
               f"{_fmt_keys(unpaired)}", details={"unpaired": len(unpaired)})
    keys = sorted(set(c_by) & set(p_by))
    n = len(keys)
    c_out = [c_by[k] for k in keys]
    p_out = [p_by[k] for k in keys]
    errored = sum(o.error is not None for o in c_out + p_out)
    if n and errored / (2 * n) > config.max_error_fraction:
        reason("errors", False, f"{name}: {errored} of {2 * n} sessions errored (allowed fraction "
               f"{config.max_error_fraction:.2f})", value=errored / (2 * n), bound=config.max_error_fraction)
    if n == 0 and not c_by and not p_by and not unpaired and sg.allow_empty and not reasons:
        reason("empty_suite", True, f"{name}: the suite holds no task on either side (allowed for this suite)")
        return SuiteReport(suite=name, gated=gated, suite_version=cand.suite_version, passed=True, n_pairs=0,
                           n_tasks=0, method=method), reasons
    if n < (sg.min_pairs or 1):
        reason("too_few_pairs", False, f"{name}: {n} paired outcomes, need at least {sg.min_pairs}",
               value=float(n), bound=float(sg.min_pairs or 1))
    report = SuiteReport(suite=name, gated=gated, suite_version=cand.suite_version, passed=False, n_pairs=n,
                         n_tasks=len({k[0] for k in keys}), method=method)
    if n == 0:
        return report, reasons

    kc = sum(o.passed for o in c_out)
    kp = sum(o.passed for o in p_out)
    b = sum(x.passed and not y.passed for x, y in zip(c_out, p_out))
    c = sum(y.passed and not x.passed for x, y in zip(c_out, p_out))
    diff = (kc - kp) / n
    if method == "bootstrap":
        seed = np.random.SeedSequence([config.seed, zlib.crc32(name.encode())])
        lo, hi = paired_bootstrap_interval([k[0] for k in keys], [int(x.passed) - int(y.passed)
                                                                  for x, y in zip(c_out, p_out)],
                                           confidence=config.confidence, two_sided=config.two_sided,
                                           resamples=config.bootstrap_resamples, seed=seed)
    else:
        lo, hi = mcnemar_exact_interval(b, c, n, confidence=config.confidence, two_sided=config.two_sided)
    tol = sg.tolerance or 0.0
    side = "two-sided" if config.two_sided else "one-sided"
    ni_ok = lo > -tol
    reason("non_inferiority", ni_ok,
           f"{name}: candidate {kc}/{n} vs production {kp}/{n}, difference {diff:+.1%} "
           f"({config.confidence:.0%} {side} {method} lower bound {lo:+.1%} "
           f"{'>' if ni_ok else '<='} -{tol:.1%}); {b} newly passed, {c} newly failed pairs",
           metric="pass_rate_diff_lower_bound", value=lo, bound=-tol,
           details={"diff": diff, "low": lo, "high": hi, "candidate_only": b, "production_only": c,
                    "method": method, "confidence": config.confidence, "two_sided": config.two_sided})
    c_rate = kc / n
    reason("floor", c_rate >= sg.floor, f"{name}: candidate pass rate {c_rate:.1%} "
           f"{'meets' if c_rate >= sg.floor else 'is below'} the floor {sg.floor:.1%}",
           metric="pass_rate", value=c_rate, bound=sg.floor)
    cv, pv = monitor_values(c_out), monitor_values(p_out)
    monitors = []
    for bound in config.monitors:
        interval = None if config.monitor_rule == "point" else monitor_drift_interval(
            bound.metric, bound.worse, c_out, p_out, confidence=config.confidence, two_sided=config.two_sided,
            resamples=config.bootstrap_resamples,
            seed=np.random.SeedSequence([config.seed, zlib.crc32(name.encode()), zlib.crc32(bound.metric.encode())]))
        m = check_monitor(bound, cv[bound.metric], pv[bound.metric], interval)
        monitors.append(m)
        allowed = "" if m.allowed_drift is None else f", allowed {m.allowed_drift:.4g}"
        lim = "" if m.limit is None else f", limit {m.limit:.4g}"
        bound_text = "" if m.drift_low is None else f" ({config.confidence:.0%} {side} lower bound {m.drift_low:+.4g})"
        reason("monitor", m.passed, f"{name}: {m.metric} {m.candidate:.4g} vs production {m.production:.4g}: "
               f"drift toward {m.worse} {m.drift:+.4g}{bound_text}{allowed}{lim} -> {'ok' if m.passed else 'BREACH'}",
               metric=m.metric, value=m.candidate, bound=m.limit, details=m.model_dump())

    cs, ps = _task_solved(c_out), _task_solved(p_out)
    report = report.model_copy(update=dict(
        candidate=PassRate(rate=c_rate, n=n, **dict(zip(("low", "high"), wilson_interval(kc, n, config.confidence)))),
        production=PassRate(rate=kp / n, n=n, **dict(zip(("low", "high"),
                                                         wilson_interval(kp, n, config.confidence)))),
        diff=diff, diff_low=lo, diff_high=hi, candidate_only=b, production_only=c, monitors=monitors,
        newly_solved=sorted(t for t in cs if cs[t] and not ps[t]),
        newly_broken=sorted(t for t in cs if ps[t] and not cs[t]),
    ))
    return report, reasons


def decide_gate(candidate: Mapping[str, SuiteOutcomes], production: Mapping[str, SuiteOutcomes],
                config: GateConfig) -> GateResult:
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
        reasons.append(GateReason(check="no_gated_suites", passed=False,
                                  message="the gate config names no gated suite; refusing to pass"))
    for name in names:
        is_gated = name in gated
        report, rs = _evaluate_suite(name, is_gated, candidate.get(name), production.get(name), config)
        ok = all(r.passed for r in rs) and (report.n_pairs > 0 or any(r.check == "empty_suite" for r in rs))
        report = report.model_copy(update={"passed": ok})
        suites[name] = report
        reasons.extend(rs)
    passed = bool(gated) and all(r.passed for r in reasons if r.gated) and all(suites[s].passed for s in gated)
    return GateResult(passed=passed, reasons=reasons, suites=suites, config=config.model_dump(mode="json"))

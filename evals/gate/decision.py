"""The promotion gate: a pure decision over paired eval outcomes (no DB, no IO).

Invariant: the gate fails closed, decides by its intervals and knows what it cannot know. Each
gated suite ends ``pass``, ``fail``, ``insufficient_evidence`` or (allowed to be empty and empty)
``not_gated``. A suite passes when its results pair one-to-one with production's (same suite
version, same (task, sample) keys), the lower bound of pass@1(candidate) - pass@1(production)
clears its threshold (``-margin`` for a guardrail, 0 for a success suite), the candidate meets
the suite's floor and no behaviour monitor breaches (``GateConfig.monitor_rule``). Missing,
unpaired or errored results, a breached floor or monitor, and an interval wholly below 0 fail.
An interval that reaches below the threshold fails on a guardrail with the design power
(``min_power``, :mod:`evals.gate.power`) and is ``insufficient_evidence`` on one without: power sizes
suites and is reported beside each decision, and never withholds a pass. A guardrail that cannot
be sized (``SuiteGate.check = "deterioration"``: production near 0 %, or a suite still growing) fails
only when its interval lies wholly below 0, and is otherwise decided by its floor and monitors. The
gate passes when
every gated guardrail passes and, where success suites are gated, one of them passes (Spotify
Confidence's rule, Schultzberg et al. 2024); a gate where no suite was gated fails.

The fixed-n interval (``GateConfig.method``, default ``newcombe``) is Newcombe's paired score
interval, which keeps its coverage at small n and rates near 0 or 1; where a cluster (a template,
``GateConfig.cluster_by``, or a task's samples) holds several pairs the gate takes the wider of it
and the cluster bootstrap (:func:`app.core.intervals.paired_bootstrap_interval`). Beside it every
suite reports the anytime-valid confidence sequence over its clusters (``GateConfig.sequence``:
normal-mixture or betting, :mod:`evals.gate.sequential`) and where it stopped; ``decide_by = "sequential"`` makes that the
deciding bound. A candidate run that stopped early (``early_stop``) is read as the prefix of its
clusters in the sequence's order (:func:`evals.gate.checks.stopped_prefix`) and accepted only where
the sequence, recomputed here, decides within it (``stopped_early``). The parts live in :mod:`evals.gate.checks`, the data models in
:mod:`evals.gate.models`; the names tests and reports use are re-exported here.

Size: over 400 lines: one pure decision, its checks in the order they apply (the statistics live in
:mod:`evals.gate.checks`, the types in :mod:`evals.gate.models`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping, Sequence

from app.core.intervals import (
    mcnemar_exact_interval,
    newcombe_paired_interval,
    paired_bootstrap_interval,
    wilson_interval,
)
from app.models.checkpoints import GateVerdict
from evals.gate.checks import (
    Pairs,
    Reasons,
    check_monitors,
    cluster_ids,
    difference_interval,
    interval_verdict,
    pair_outcomes,
    sequential_report,
    stopped_prefix,
)
from evals.gate.models import (
    Decision,
    GateReason,
    GateResult,
    Key,
    MonitorReport,
    Outcome,
    PassRate,
    SamplingReport,
    SequentialReport,
    SuiteDecision,
    SuiteOutcomes,
    SuiteReport,
)
from evals.gate.monitors import check_monitor, monitor_drift_interval, monitor_values
from evals.gate.passk import pass_at_k, sampling_report, task_counts
from evals.gate.policy import GateConfig, SuiteGate
from evals.gate.power import non_inferiority_power

__all__ = [
    "Decision",
    "GateReason",
    "GateResult",
    "Key",
    "MonitorReport",
    "Outcome",
    "PassRate",
    "SamplingReport",
    "SequentialReport",
    "SuiteDecision",
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
    "wilson_interval",
]


def _task_solved(outcomes: Sequence[Outcome]) -> dict[str, bool]:
    """Task solved = at least half of its samples passed (majority over samples)."""
    per: dict[str, list[bool]] = defaultdict(list)
    for o in outcomes:
        per[o.task_id].append(o.passed)
    return {t: 2 * sum(v) >= len(v) for t, v in per.items()}


def _paired_sampling(outcomes: Sequence[Outcome]) -> SamplingReport:
    """pass@k of one side's paired outcomes (:func:`evals.gate.passk.sampling_report`).

    Raises:
        ValueError: ``outcomes`` is empty (the gate reports pass@k only once something paired).
    """
    report = sampling_report(outcomes)
    if report is None:
        raise ValueError("pass@k of an empty side: the gate computes it only for a suite with pairs")
    return report


def _empty_report(
    name: str,
    gated: bool,
    version: str | None,
    config: GateConfig,
    role: str,
    decision: SuiteDecision = GateVerdict.FAIL,
) -> SuiteReport:
    """A report with no pairs yet: ``decision`` is ``not_gated`` for an empty suite allowed to be empty."""
    return SuiteReport(
        suite=name,
        gated=gated,
        suite_version=version,
        passed=False,
        n_pairs=0,
        n_tasks=0,
        method=config.method,
        role=role,
        decision=decision,
    )


def _check_power(
    name: str, pairs: Pairs, margin: float, config: GateConfig, reasons: Reasons, planned: int | None, k: int
) -> float:
    """The power figure (:mod:`evals.gate.power`), an informational reason: it sizes the suite and says
    whether an interval below the margin is a failure, and never withholds a pass. It is the plan's
    power: at its ``planned`` pairs (k samples x tasks; the pairs that ran where the plan is not
    known), at production's observed rate."""
    base = sum(o.passed for o in pairs.production) / pairs.n
    n = max(pairs.n, planned or 0)
    power = non_inferiority_power(
        n,
        base,
        margin,
        confidence=config.confidence,
        two_sided=config.two_sided,
        sims=config.power_sims,
        seed=config.seed,
    )
    powered = power >= config.min_power
    reasons.add(
        "power",
        powered,
        f"{name}: power {power:.2f} to tell an equal candidate from one {margin:.1%} worse at {n} pairs "
        f"({k} sample{'s' if k > 1 else ''} a task) and production's {base:.1%} (design {config.min_power:.2f}"
        + ("" if powered else "; an interval below the margin is insufficient evidence, not a failure")
        + ")",
        metric="power",
        value=power,
        bound=config.min_power,
        details={"n": n, "samples_per_task": k, "base_rate": base, "margin": margin, "sims": config.power_sims},
        informational=True,
    )
    return power


def _check_difference(
    report: SuiteReport,
    pairs: Pairs,
    sg: SuiteGate,
    power: float | None,
    diff: float,
    config: GateConfig,
    reasons: Reasons,
    planned_clusters: list[str] | None = None,
) -> SuiteReport:
    """The deciding comparison: the fixed-n interval and the confidence sequence against the
    suite's threshold, one reason (``non_inferiority`` for a guardrail, ``superiority`` for a
    success suite) read from the bounds ``decide_by`` names. ``diff`` is pass@1(candidate) -
    pass@1(production), the point estimate reported beside the bounds. ``planned_clusters``: the
    plan's clusters when the run stopped early (the sequence's order and tuning come from them)."""
    name, guardrail, margin = report.suite, sg.role == "guardrail", sg.margin or 0.0
    threshold = -margin if guardrail else 0.0
    c_out, p_out, n = pairs.candidate, pairs.production, pairs.n
    b = sum(x.passed and not y.passed for x, y in zip(c_out, p_out))
    c = sum(y.passed and not x.passed for x, y in zip(c_out, p_out))
    both = sum(x.passed and y.passed for x, y in zip(c_out, p_out))
    clusters = cluster_ids(pairs, config)
    lo, hi = difference_interval(name, pairs, clusters, (both, b, c, n - both - b - c), config)
    seq = sequential_report(
        name, pairs, clusters, threshold, config, guardrail=guardrail, planned_clusters=planned_clusters
    )
    powered = power is not None and power >= config.min_power
    if config.decide_by == "sequential":
        verdict, low, high, stopped = seq.decision, seq.low, seq.high, seq.stopped_at_pairs
        how = f"{config.sequence.replace('_', '-')} confidence sequence over {seq.clusters} clusters"
    else:
        verdict, low, high, stopped = (
            interval_verdict(lo, hi, threshold, guardrail=guardrail, powered=powered),
            lo,
            hi,
            n,
        )
        how = config.method + (" or cluster bootstrap, the wider" if len(set(clusters)) < n else "")
    deterioration = sg.check == "deterioration"
    if deterioration:
        verdict = GateVerdict.FAIL if high < 0 else GateVerdict.PASS
    kc, kp = sum(o.passed for o in c_out), sum(o.passed for o in p_out)
    side = "two-sided" if config.two_sided else "one-sided"
    stop = "" if seq.stopped_at_pairs is None else f" at {seq.stopped_at_pairs} pairs"
    if planned_clusters is not None:
        stop += f" (the run stopped there: {seq.stopped_at_clusters} of {seq.clusters} clusters)"
    why = {
        GateVerdict.PASS: "",
        GateVerdict.FAIL: "",
        GateVerdict.INSUFFICIENT_EVIDENCE: "; the bounds cannot decide: insufficient evidence",
    }
    bound_said = f"lower bound {'>' if low > threshold else '<='} {threshold:+.1%}"
    if deterioration:
        why = {
            v: "; a deterioration check (not sized): floor and monitors decide"
            for v in (GateVerdict.PASS, GateVerdict.FAIL)
        }
        bound_said = f"upper bound {'<' if high < 0 else '>='} 0: {'significantly worse' if high < 0 else 'not worse'}"
    reasons.add(
        "deterioration" if deterioration else "non_inferiority" if guardrail else "superiority",
        verdict == GateVerdict.PASS,
        f"{name}: candidate {kc}/{n} vs production {kp}/{n} ({report.n_tasks} tasks x {report.samples_per_task} "
        f"sample{'s' if report.samples_per_task > 1 else ''}, {len(set(clusters))} clusters), difference {diff:+.1%} "
        f"({config.confidence:.0%} {side} {how} [{low:+.1%}, {high:+.1%}], {bound_said}); "
        f"{b} newly passed, {c} newly failed pairs; "
        f"sequence [{seq.low:+.1%}, {seq.high:+.1%}] {seq.decision}{stop}{why[verdict]}",
        metric="pass_rate_diff_upper_bound" if deterioration else "pass_rate_diff_lower_bound",
        value=high if deterioration else low,
        bound=0.0 if deterioration else threshold,
        details={
            "diff": diff,
            "low": low,
            "high": high,
            "interval": [lo, hi],
            "sequence": [seq.low, seq.high],
            "candidate_only": b,
            "production_only": c,
            "method": config.method,
            "decide_by": config.decide_by,
            "confidence": config.confidence,
            "two_sided": config.two_sided,
        },
        inconclusive=verdict == GateVerdict.INSUFFICIENT_EVIDENCE,
    )
    return report.model_copy(
        update=dict(
            diff=diff,
            diff_low=lo,
            diff_high=hi,
            threshold=0.0 if deterioration else threshold,
            check=sg.check,
            decided_by=config.decide_by,
            clusters=len(set(clusters)),
            sequential=seq,
            stopped_at_pairs=stopped,
            candidate_only=b,
            production_only=c,
        )
    )


def _check_stop(report: SuiteReport, pairs: Pairs, reasons: Reasons) -> SuiteReport:
    """A run that stopped early is accepted only where the confidence sequence, recomputed here from
    the stored outcomes, decides within the clusters it ran; otherwise its missing pairs fail
    closed (a rerun of the gate resumes the run and completes it)."""
    seq = report.sequential
    decides = (
        f"the confidence sequence decides at {seq.stopped_at_pairs} of them ({seq.decision})"
        if seq is not None and seq.stopped_at_pairs is not None
        else None
    )
    reasons.add(
        "stopped_early",
        decides is not None,
        f"{report.suite}: the candidate's run stopped after {pairs.n} pairs; "
        + (decides or "the confidence sequence does not decide there, so the unrun pairs count as missing"),
        value=float(pairs.n),
        details={"stopped_at_clusters": None if seq is None else seq.stopped_at_clusters},
    )
    return report.model_copy(update=dict(run_stopped=True))


def _check_floor(name: str, pairs: Pairs, floor: float, reasons: Reasons) -> None:
    rate = sum(o.passed for o in pairs.candidate) / pairs.n
    reasons.add(
        "floor",
        rate >= floor,
        f"{name}: candidate pass rate {rate:.1%} {'meets' if rate >= floor else 'is below'} the floor {floor:.1%}",
        metric="pass_rate",
        value=rate,
        bound=floor,
    )


def _rates(
    report: SuiteReport, pairs: Pairs, sampling: tuple[SamplingReport, SamplingReport], config: GateConfig
) -> SuiteReport:
    """The per-side pass rates (Wilson), pass@k (``sampling``: candidate's, production's) and which
    tasks changed."""
    n, c_out, p_out = pairs.n, pairs.candidate, pairs.production
    kc, kp = sum(o.passed for o in c_out), sum(o.passed for o in p_out)
    cs, ps = _task_solved(c_out), _task_solved(p_out)
    return report.model_copy(
        update=dict(
            candidate=PassRate(
                rate=kc / n, n=n, **dict(zip(("low", "high"), wilson_interval(kc, n, config.confidence)))
            ),
            production=PassRate(
                rate=kp / n, n=n, **dict(zip(("low", "high"), wilson_interval(kp, n, config.confidence)))
            ),
            newly_solved=sorted(t for t in cs if cs[t] and not ps[t]),
            newly_broken=sorted(t for t in cs if ps[t] and not cs[t]),
            samples_per_task=max(k for k, _ in task_counts(c_out).values()),
            candidate_sampling=sampling[0],
            production_sampling=sampling[1],
        )
    )


def _evaluate_suite(
    name: str, gated: bool, cand: SuiteOutcomes | None, prod: SuiteOutcomes | None, config: GateConfig
) -> tuple[SuiteReport, list[GateReason]]:
    """Every check of one suite on its paired outcomes, and the report they fill in. All samples
    of a task pair by ``(task, sample_index)``; the difference is pass@1(candidate) -
    pass@1(production), the mean over tasks of each task's mean paired difference."""
    sg = config.for_suite(name)
    reasons = Reasons(name, gated, [])
    if cand is None and prod is None and sg.allow_empty:
        reasons.add("empty_suite", True, f"{name}: neither side ran the suite (allowed to be empty): not gated")
        return _empty_report(name, gated, None, config, decision=GateVerdict.NOT_GATED, role=sg.role), reasons.items
    if cand is None or prod is None:
        missing = [who for who, x in (("candidate", cand), ("production", prod)) if x is None]
        reasons.add(
            "missing_suite", False, f"{name}: no results for {' and '.join(missing)}", details={"missing": missing}
        )
        return _empty_report(name, gated, None, config, role=sg.role), reasons.items
    planned_pairs = len(cand.planned) if cand.planned is not None else None
    planned_clusters = None
    if (cand.stopped or prod.stopped) and config.early_stop and cand.planned is not None:
        cand, prod, planned_clusters = stopped_prefix(name, cand, prod, config)
    pairs = pair_outcomes(cand, prod, config, reasons)
    if pairs.empty and sg.allow_empty and not reasons.items:
        reasons.add("empty_suite", True, f"{name}: the suite holds no task on either side (allowed): not gated")
        return _empty_report(
            name, gated, cand.suite_version, config, decision=GateVerdict.NOT_GATED, role=sg.role
        ), reasons.items
    if pairs.n < (sg.min_pairs or 1):
        reasons.add(
            "too_few_pairs",
            False,
            f"{name}: {pairs.n} paired outcomes, need at least {sg.min_pairs}: insufficient evidence",
            value=float(pairs.n),
            bound=float(sg.min_pairs or 1),
            inconclusive=True,
        )
    report = _empty_report(name, gated, cand.suite_version, config, role=sg.role)
    if pairs.n == 0:
        return report, reasons.items
    sampling = _paired_sampling(pairs.candidate), _paired_sampling(pairs.production)
    report = _rates(
        report.model_copy(update=dict(n_pairs=pairs.n, n_tasks=len({k[0] for k in pairs.keys}))),
        pairs,
        sampling,
        config,
    )
    margin = sg.margin or 0.0
    power = (
        None
        if sg.check == "deterioration"
        else _check_power(name, pairs, margin, config, reasons, planned_pairs, report.samples_per_task)
    )
    diff = sampling[0].pass_at_k["1"] - sampling[1].pass_at_k["1"]
    report = _check_difference(report, pairs, sg, power, diff, config, reasons, planned_clusters)
    if planned_clusters is not None:
        report = _check_stop(report, pairs, reasons)
    report = report.model_copy(update=dict(planned_pairs=planned_pairs))
    _check_floor(name, pairs, sg.floor, reasons)
    monitors = check_monitors(name, pairs, config, reasons)
    return report.model_copy(update=dict(power=power, margin=margin, monitors=monitors)), reasons.items


def _suite_decision(report: SuiteReport, reasons: list[GateReason]) -> SuiteDecision:
    """``not_gated`` as the report says; ``fail`` when a deciding check failed outright, else
    ``insufficient_evidence`` when one could not decide (or nothing paired), else ``pass``."""
    if report.decision == GateVerdict.NOT_GATED:
        return GateVerdict.NOT_GATED
    deciding = [r for r in reasons if not r.informational]
    if any(not r.passed and not r.inconclusive for r in deciding):
        return GateVerdict.FAIL
    if any(not r.passed for r in deciding) or report.n_pairs == 0:
        return GateVerdict.INSUFFICIENT_EVIDENCE
    return GateVerdict.PASS


def _gate_decision(reports: list[SuiteReport]) -> Decision:
    """Spotify Confidence's rule over the gated suites that decided: ``fail`` if none decided or
    one failed; ``pass`` if every guardrail passed and, where success suites decided, one passed;
    else ``insufficient_evidence``."""
    decided = [s for s in reports if s.decision != GateVerdict.NOT_GATED]
    if not decided or any(s.decision == GateVerdict.FAIL for s in decided):
        return GateVerdict.FAIL
    guardrails = [s for s in decided if s.role == "guardrail"]
    successes = [s for s in decided if s.role == "success"]
    if all(s.decision == GateVerdict.PASS for s in guardrails) and (
        not successes or any(s.decision == GateVerdict.PASS for s in successes)
    ):
        return GateVerdict.PASS
    return GateVerdict.INSUFFICIENT_EVIDENCE


def decide_gate(
    candidate: Mapping[str, SuiteOutcomes], production: Mapping[str, SuiteOutcomes], config: GateConfig
) -> GateResult:
    """Decide whether ``candidate`` may be promoted over ``production``.

    Args:
        candidate: the candidate's outcomes by suite name.
        production: production's outcomes by suite name (same suite versions expected).
        config: the gate policy.

    Returns:
        A :class:`GateResult`: ``decision`` is ``fail`` when no gated suite decided (none gated, or
        every one ``not_gated``) or a gated suite failed, ``pass`` under the success-and-guardrails
        rule (:func:`_gate_decision`), else ``insufficient_evidence``. Ungated suites present on
        both sides are reported, never decisive.
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
        report, rs = _evaluate_suite(name, name in gated, candidate.get(name), production.get(name), config)
        decision = _suite_decision(report, rs)
        suites[name] = report.model_copy(update={"passed": decision == GateVerdict.PASS, "decision": decision})
        reasons.extend(rs)
    overall = _gate_decision([suites[s] for s in gated])
    if gated and all(suites[s].decision == GateVerdict.NOT_GATED for s in gated):
        reasons.append(
            GateReason(
                check="no_gated_suites",
                passed=False,
                message="no gated suite had outcomes to compare; refusing to pass",
            )
        )
    return GateResult(
        passed=overall == GateVerdict.PASS,
        decision=overall,
        reasons=reasons,
        suites=suites,
        config=config.model_dump(mode="json"),
    )

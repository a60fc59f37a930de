"""The gate's parts on one suite: pairing, the difference's bounds, and the behaviour monitors.

Invariant: pure functions of outcomes and the policy (no DB, no IO), each seeded by the gate's seed
and the suite's name, so a stored decision can be recomputed. :mod:`evals.gate` composes them.
"""

from __future__ import annotations

import zlib
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import Any

import numpy as np

from app.core.intervals import mcnemar_exact_interval, newcombe_paired_interval, paired_bootstrap_interval
from app.models.checkpoints import GateVerdict
from evals.gate.models import Decision, GateReason, Key, MonitorReport, Outcome, SequentialReport, SuiteOutcomes
from evals.gate.monitors import check_monitor, monitor_drift_interval, monitor_values
from evals.gate.policy import GateConfig
from evals.gate.sequential import betting_confidence_sequence, normal_mixture_confidence_sequence
from evals.tasks.functions import template_of


@dataclass
class Reasons:
    """The reasons of one suite, collected in check order."""

    suite: str
    gated: bool
    items: list[GateReason]

    def add(self, check: str, passed: bool, message: str, **kw: Any) -> None:
        """Record one check's verdict (``kw``: the other :class:`GateReason` fields)."""
        self.items.append(
            GateReason(check=check, suite=self.suite, gated=self.gated, passed=passed, message=message, **kw)
        )


@dataclass(frozen=True)
class Pairs:
    """The outcomes that pair by ``(task, sample)``, in key order, and what did not pair."""

    keys: list[Key]
    candidate: list[Outcome]
    production: list[Outcome]
    unpaired: int
    empty: bool
    """Neither side holds any outcome."""

    @property
    def n(self) -> int:
        return len(self.keys)

    def differences(self) -> list[int]:
        """Each pair's candidate - production pass indicator (-1, 0 or +1)."""
        return [int(x.passed) - int(y.passed) for x, y in zip(self.candidate, self.production)]


def _fmt_keys(keys: set[Key], limit: int = 5) -> str:
    shown = ", ".join(f"{t}#{i}" for t, i in sorted(keys)[:limit])
    return shown + (f" (+{len(keys) - limit} more)" if len(keys) > limit else "")


def pair_outcomes(cand: SuiteOutcomes, prod: SuiteOutcomes, config: GateConfig, reasons: Reasons) -> Pairs:
    """Pair both sides by ``(task, sample)`` and record what breaks the pairing: another suite
    version, planned results missing, outcomes without a partner, errored sessions over the
    allowed fraction (each a failed reason)."""
    name = reasons.suite
    if cand.suite_version != prod.suite_version:
        reasons.add(
            "version_mismatch",
            False,
            f"{name}: candidate ran suite version {cand.suite_version}, production {prod.suite_version}",
            details={"candidate": cand.suite_version, "production": prod.suite_version},
        )
    c_by = {o.key: o for o in cand.outcomes}
    p_by = {o.key: o for o in prod.outcomes}
    for who, side, by in (("candidate", cand, c_by), ("production", prod, p_by)):
        if side.planned is not None and (missing := set(side.planned) - set(by)):
            reasons.add(
                "missing_results",
                False,
                f"{name}: {who} lacks {len(missing)} planned results: {_fmt_keys(missing)}",
                details={"side": who, "missing": len(missing)},
            )
    unpaired = set(c_by) ^ set(p_by)
    if unpaired:
        reasons.add(
            "unpaired",
            False,
            f"{name}: {len(unpaired)} (task, sample) outcomes without a partner: {_fmt_keys(unpaired)}",
            details={"unpaired": len(unpaired)},
        )
    keys = sorted(set(c_by) & set(p_by))
    pairs = Pairs(keys, [c_by[k] for k in keys], [p_by[k] for k in keys], len(unpaired), not c_by and not p_by)
    errored = sum(o.error is not None for o in pairs.candidate + pairs.production)
    if pairs.n and errored / (2 * pairs.n) > config.max_error_fraction:
        reasons.add(
            "errors",
            False,
            f"{name}: {errored} of {2 * pairs.n} sessions errored (allowed fraction {config.max_error_fraction:.2f})",
            value=errored / (2 * pairs.n),
            bound=config.max_error_fraction,
        )
    return pairs


def cluster_of(task_id: str, config: GateConfig) -> str:
    """A task's cluster: its template under ``cluster_by = "template"`` where the task has one
    (``evals.tasks.functions.template_of``), else the task itself."""
    return task_id if config.cluster_by == "task" else template_of(task_id) or task_id


def cluster_ids(pairs: Pairs, config: GateConfig) -> list[str]:
    """Each pair's cluster (:func:`cluster_of`)."""
    return [cluster_of(k[0], config) for k in pairs.keys]


def stopped_prefix(
    name: str, cand: SuiteOutcomes, prod: SuiteOutcomes, config: GateConfig
) -> tuple[SuiteOutcomes, SuiteOutcomes, list[str]]:
    """The part of a run that stopped early (``early_stop``) that the confidence sequence may read:
    the clusters of the candidate's plan in :func:`sequence_order`, up to the first one whose
    planned keys are not all present on both sides.

    Args:
        name: the suite.
        cand: the candidate's outcomes; its ``planned`` keys define the clusters.
        prod: production's outcomes on the same plan.
        config: the gate policy (``cluster_by``, ``seed``).

    Returns:
        ``(candidate, production, planned_clusters)``: both sides with outcomes and ``planned``
        restricted to that prefix (results stored after the stop, beyond it, are dropped), and every
        cluster of the plan (the sequence is tuned to their count and looks in their order).
    """
    planned = list(cand.planned or [])
    members: dict[str, list[Key]] = defaultdict(list)
    for key in planned:
        members[cluster_of(key[0], config)].append(key)
    have_c, have_p = {o.key for o in cand.outcomes}, {o.key for o in prod.outcomes}
    keep: set[Key] = set()
    for cluster in sequence_order(name, set(members), config):
        if not all(k in have_c and k in have_p for k in members[cluster]):
            break
        keep.update(members[cluster])

    def restrict(side: SuiteOutcomes) -> SuiteOutcomes:
        return replace(
            side,
            outcomes=[o for o in side.outcomes if o.key in keep],
            planned=[k for k in planned if k in keep],
        )

    return restrict(cand), restrict(prod), sorted(members)


def _seed(config: GateConfig, name: str, *more: str) -> np.random.SeedSequence:
    return np.random.SeedSequence([config.seed, zlib.crc32(name.encode()), *(zlib.crc32(m.encode()) for m in more)])


def difference_interval(
    name: str, pairs: Pairs, clusters: list[str], table: tuple[int, int, int, int], config: GateConfig
) -> tuple[float, float]:
    """The fixed-n interval of candidate - production under ``config.method``; ``table`` is the
    paired 2x2 table (both passed, candidate only, production only, neither). ``newcombe`` takes
    the wider of the score interval (which treats pairs as independent) and the cluster bootstrap
    whenever a cluster holds more than one pair."""
    if config.method == "mcnemar":
        _, b, c, _ = table
        return mcnemar_exact_interval(b, c, pairs.n, confidence=config.confidence, two_sided=config.two_sided)
    score = newcombe_paired_interval(*table, confidence=config.confidence, two_sided=config.two_sided)
    if config.method == "newcombe" and len(set(clusters)) == pairs.n:
        return score
    boot = paired_bootstrap_interval(
        clusters,
        pairs.differences(),
        confidence=config.confidence,
        two_sided=config.two_sided,
        resamples=config.bootstrap_resamples,
        seed=_seed(config, name),
    )
    if config.method == "bootstrap":
        return boot
    return min(score[0], boot[0]), max(score[1], boot[1])


def interval_verdict(low: float, high: float, threshold: float, *, guardrail: bool, powered: bool) -> Decision:
    """What bounds say against ``threshold`` (``-margin`` for a guardrail, 0 for a success suite):
    ``pass`` when the lower bound clears it; ``fail`` when the upper bound is below 0 (the candidate
    is worse), or, on a guardrail with the design power, when the lower bound reaches the margin;
    otherwise ``insufficient_evidence``."""
    if low > threshold:
        return GateVerdict.PASS
    if high < 0 or (guardrail and powered):
        return GateVerdict.FAIL
    return GateVerdict.INSUFFICIENT_EVIDENCE


def sequence_order(name: str, clusters: set[str], config: GateConfig) -> list[str]:
    """The order in which the confidence sequence of suite ``name`` looks at ``clusters``: a
    permutation seeded by the gate's seed and the suite's name, fixed before any outcome is seen
    (what keeps a stop valid). A runner that evaluates cluster by cluster in this order and stops
    when the sequence decides spends only ``stopped_at_pairs`` sessions."""
    names = sorted(clusters)
    return [names[i] for i in np.random.default_rng(_seed(config, name, "sequence")).permutation(len(names))]


def sequence_verdict(
    means: np.ndarray, sizes: np.ndarray, planned: int, threshold: float, config: GateConfig, *, guardrail: bool
) -> SequentialReport:
    """The confidence sequence (``config.sequence``) over cluster means in look order, stopped at
    the first look where its bounds pass or fail the suite (:func:`interval_verdict`, no power rule:
    with looks at every cluster, "the margin is within the sequence" carries no power argument).

    Args:
        means: float ``[t]``, each looked-at cluster's mean paired difference (candidate -
            production pass indicator), in look order; ``t`` may be less than ``planned`` (a run
            still going, or one that stopped).
        sizes: int ``[t]``, pairs in each of those clusters.
        planned: clusters in the plan (``t*`` of the normal mixture; the report's ``clusters``).
        threshold: ``-margin`` for a guardrail, 0 for a success suite.
        config: ``sequence``, ``sequence_burn_in``, ``confidence``, ``two_sided``.
        guardrail: whether a lower bound at or below the threshold with the upper bound above 0
            stays undecided (it does either way without power).

    Returns:
        A :class:`SequentialReport`; ``insufficient_evidence`` with ``stopped_at_pairs`` None when
        no look decided (or nothing was looked at).
    """
    alpha = (1 - config.confidence) / (2 if config.two_sided else 1)
    if len(means) == 0:
        return SequentialReport(low=-1.0, high=1.0, clusters=planned, decision=GateVerdict.INSUFFICIENT_EVIDENCE)
    if config.sequence == "betting":
        cs = betting_confidence_sequence(means, alpha)
    else:
        cs = normal_mixture_confidence_sequence(means, max(planned, 1), alpha, config.sequence_burn_in)
    cumulative = np.cumsum(sizes)
    for t, (low, high) in enumerate(zip(cs.low, cs.high)):
        verdict = interval_verdict(float(low), float(high), threshold, guardrail=guardrail, powered=False)
        if verdict != GateVerdict.INSUFFICIENT_EVIDENCE:
            return SequentialReport(
                low=float(low),
                high=float(high),
                clusters=planned,
                stopped_at_clusters=t + 1,
                stopped_at_pairs=int(cumulative[t]),
                decision=verdict,
            )
    return SequentialReport(
        low=float(cs.low[-1]), high=float(cs.high[-1]), clusters=planned, decision=GateVerdict.INSUFFICIENT_EVIDENCE
    )


def sequential_report(
    name: str,
    pairs: Pairs,
    clusters: list[str],
    threshold: float,
    config: GateConfig,
    *,
    guardrail: bool,
    planned_clusters: list[str] | None = None,
) -> SequentialReport:
    """The confidence sequence over the suite's clusters in a seeded random order
    (:func:`sequence_order`, one look after each; :func:`sequence_verdict`). ``planned_clusters``
    (a run that stopped early, :func:`stopped_prefix`) are the plan's clusters: the order and the
    tuning come from them, and the looks end at the first one without pairs. A run that ends
    without a decision is insufficient evidence."""
    by: dict[str, list[int]] = defaultdict(list)
    for cluster, d in zip(clusters, pairs.differences()):
        by[cluster].append(d)
    order = sequence_order(name, set(planned_clusters) if planned_clusters is not None else set(by), config)
    looked = []
    for cluster in order:
        if cluster not in by:
            break
        looked.append(cluster)
    means = np.array([np.mean(by[c]) for c in looked], dtype=np.float64)
    sizes = np.array([len(by[c]) for c in looked], dtype=np.int64)
    return sequence_verdict(means, sizes, len(order), threshold, config, guardrail=guardrail)


def check_monitors(name: str, pairs: Pairs, config: GateConfig, reasons: Reasons) -> list[MonitorReport]:
    """Every behaviour monitor of the policy on the pairs, each a reason (``BREACH`` fails)."""
    cv, pv = monitor_values(pairs.candidate), monitor_values(pairs.production)
    side = "two-sided" if config.two_sided else "one-sided"
    monitors = []
    for bound in config.monitors:
        interval = (
            None
            if config.monitor_rule == "point"
            else monitor_drift_interval(
                bound.metric,
                bound.worse,
                pairs.candidate,
                pairs.production,
                confidence=config.confidence,
                two_sided=config.two_sided,
                resamples=config.bootstrap_resamples,
                seed=_seed(config, name, bound.metric),
            )
        )
        m = check_monitor(bound, cv[bound.metric], pv[bound.metric], interval)
        monitors.append(m)
        allowed = "" if m.allowed_drift is None else f", allowed {m.allowed_drift:.4g}"
        lim = "" if m.limit is None else f", limit {m.limit:.4g}"
        bound_text = "" if m.drift_low is None else f" ({config.confidence:.0%} {side} lower bound {m.drift_low:+.4g})"
        reasons.add(
            "monitor",
            m.passed,
            f"{name}: {m.metric} {m.candidate:.4g} vs production {m.production:.4g}: "
            f"drift toward {m.worse} {m.drift:+.4g}{bound_text}{allowed}{lim} -> {'ok' if m.passed else 'BREACH'}",
            metric=m.metric,
            value=m.candidate,
            bound=m.limit,
            details=m.model_dump(),
        )
    return monitors

"""Interval statistics of the gate: Wilson, Newcombe's paired score interval, the task-clustered
paired bootstrap, exact McNemar.

Invariant: pure functions of counts and arrays (numpy, scipy); same inputs and seed, same interval.

- *Paired bootstrap*: percentile interval of the mean paired difference, resampling tasks with
  replacement (a cluster bootstrap, so the samples of one task move together).
  Efron & Tibshirani, *An Introduction to the Bootstrap* (1993), ch. 6 and 13 (percentile
  interval); Davison & Hinkley (1997) §3.8 for resampling clusters.
- *Exact McNemar*: conditional on the ``n_d = b + c`` discordant pairs, ``b ~ Binomial(n_d, p)``
  (McNemar 1947, *Psychometrika* 12:153); a Clopper-Pearson (1934) interval for ``p`` maps to the
  difference ``(b - c) / n = (n_d / n)(2p - 1)``. It treats every (task, sample) pair as
  independent, so with several samples per task it is narrower than the data support.
- *Newcombe paired*: the hybrid score ("square-and-add") interval for the difference of two
  paired proportions, Newcombe (1998), *Stat Med* 17:2635, method 10, with the correlation
  estimate as Fagerland, Lydersen & Laake (2014), *Stat Med* 33:2850, give it. Built from two
  Wilson intervals, it keeps its coverage at small n and at rates near 0 or 1, where the
  bootstrap collapses (0/4 vs 0/4 gives the bootstrap a zero-width interval; this one spans
  about +-0.40 at one-sided 95 %).
- Wilson (1927) score intervals for one checkpoint's pass rate (two-sided, or one-sided lower on an
  effective sample size).
- *Clustered ratio metrics* (delta method): ``R = sum X / sum Y`` over units grouped in clusters
  (the samples of one task), linearised per cluster (Deng, Knoblich & Lu 2018, "Applying the Delta
  Method in Metric Analytics", arXiv 1803.06336, section 3), with the CR1 factor ``G / (G - 1)``
  over ``G`` clusters and Student-t quantiles on ``G - 1`` degrees of freedom (Cameron & Miller
  2015, "A Practitioner's Guide to Cluster-Robust Inference", J. Human Resources 50(2), section
  VI). A paired difference of two ratios on the same clusters linearises both in one cluster
  term, so the covariance the pairing creates is counted.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass

import numpy as np
from scipy import stats


def _tail(confidence: float, two_sided: bool) -> float:
    return (1.0 - confidence) / 2.0 if two_sided else 1.0 - confidence


def wilson_interval(k: int, n: int, confidence: float = 0.95) -> tuple[float, float]:
    """Two-sided Wilson score interval of a binomial proportion ``k / n`` (Wilson 1927; Agresti & Coull
    1998): ``(low, high)`` in [0, 1], ``(0.0, 1.0)`` when ``n == 0``.

    Raises:
        ValueError: ``k`` outside ``[0, n]``.
    """
    if not 0 <= k <= n:
        raise ValueError(f"k={k} outside [0, {n}]")
    if n == 0:
        return 0.0, 1.0
    return _wilson(k / n, n, float(stats.norm.ppf(1 - (1 - confidence) / 2)))


def _wilson(p: float, n: float, z: float) -> tuple[float, float]:
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    # low <= p <= high exactly: in floats centre - half at p = 0 can come out as +3e-18
    return min(p, max(0.0, centre - half)), max(p, min(1.0, centre + half))


def wilson_lower(rate: float, n: float, confidence: float = 0.99) -> float:
    """One-sided Wilson (1927) lower bound of a proportion observed as ``rate`` on ``n`` trials: the
    smallest ``p`` with ``(rate - p) / sqrt(p (1 - p) / n) <= z``, ``z`` the ``confidence`` quantile
    of the standard normal. ``n`` may be fractional: an effective sample size ``n / deff`` under a
    design effect (Korn & Graubard 1998, *Survey Methodology* 24:193, put ``n / deff`` into a
    binomial interval the same way). 0.0 when ``n <= 0``.

    Raises:
        ValueError: ``rate`` outside [0, 1] or ``confidence`` outside (0.5, 1).
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate={rate} outside [0, 1]")
    if not 0.5 < confidence < 1.0:
        raise ValueError(f"confidence={confidence} outside (0.5, 1)")
    if n <= 0:
        return 0.0
    return _wilson(rate, n, float(stats.norm.ppf(confidence)))[0]


def error_bars(values: Sequence[float], intervals: Sequence[Sequence[float] | None]) -> list[list[float]]:
    """Matplotlib's asymmetric ``yerr`` (``[below, above]``, each one per point) of ``values`` and
    their ``(low, high)`` intervals, never negative: matplotlib refuses a negative bar (even -1e-18),
    and a bootstrap interval need not hold its point. A point without an interval gets none."""
    return [
        [max(0.0, v - ci[0]) if ci else 0.0 for v, ci in zip(values, intervals)],
        [max(0.0, ci[1] - v) if ci else 0.0 for v, ci in zip(values, intervals)],
    ]


def newcombe_diff_interval(
    passed_a: int, n_a: int, passed_b: int, n_b: int, confidence: float = 0.95
) -> tuple[float, float]:
    """Interval for the difference of two independent pass rates ``a - b``.

    Newcombe's hybrid score method (Newcombe 1998, "Interval estimation for the difference between
    independent proportions", method 10), built from the two Wilson intervals:
    ``L = d - sqrt((p_a - l_a)^2 + (u_b - p_b)^2)``, ``U = d + sqrt((u_a - p_a)^2 + (p_b - l_b)^2)``.
    Returns ``(-1.0, 1.0)`` if either sample is empty.
    """
    if n_a == 0 or n_b == 0:
        return -1.0, 1.0
    pa, pb = passed_a / n_a, passed_b / n_b
    la, ua = wilson_interval(passed_a, n_a, confidence)
    lb, ub = wilson_interval(passed_b, n_b, confidence)
    d = pa - pb
    return (
        max(-1.0, d - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2)),
        min(1.0, d + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)),
    )


def newcombe_paired_arrays(
    both: np.ndarray, only_a: np.ndarray, only_b: np.ndarray, neither: np.ndarray, z: float
) -> tuple[np.ndarray, np.ndarray]:
    """:func:`newcombe_paired_interval` on arrays of 2x2 tables (vectorised, for power simulations).

    Args:
        both, only_a, only_b, neither: ``[m]`` cell counts of ``m`` paired tables (a passed and b
            passed; only a; only b; neither).
        z: normal quantile of each bound (1.645: one-sided 95 %; 1.96: two-sided 95 %).

    Returns:
        ``(low, high)`` arrays of ``p_a - p_b``, clipped to [-1, 1]; ``(-1, 1)`` for an empty table.
    """
    both, only_a, only_b, neither = (np.asarray(x, dtype=np.float64) for x in (both, only_a, only_b, neither))
    n = both + only_a + only_b + neither
    safe = np.where(n > 0, n, 1.0)
    pa, pb = (both + only_a) / safe, (both + only_b) / safe

    def wilson(p: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        denom = 1 + z * z / safe
        centre = (p + z * z / (2 * safe)) / denom
        half = z * np.sqrt(p * (1 - p) / safe + z * z / (4 * safe * safe)) / denom
        return np.maximum(0.0, centre - half), np.minimum(1.0, centre + half)

    la, ua = wilson(pa)
    lb, ub = wilson(pb)
    # Correlation of the two margins; 0 when a margin is empty, shrunk by N/2 when positive
    # (Fagerland, Lydersen & Laake 2014, eq. for the Newcombe square-and-add interval).
    margins = (both + only_a) * (only_b + neither) * (both + only_b) * (only_a + neither)
    cross = both * neither - only_a * only_b
    num = np.where(cross > n / 2, cross - n / 2, np.where(cross >= 0, 0.0, cross))
    phi = np.where(margins > 0, num / np.sqrt(np.where(margins > 0, margins, 1.0)), 0.0)
    d = pa - pb
    da, ea = pa - la, ua - pa
    db, eb = pb - lb, ub - pb
    low = d - np.sqrt(np.maximum(0.0, da * da + eb * eb - 2 * phi * da * eb))
    high = d + np.sqrt(np.maximum(0.0, db * db + ea * ea - 2 * phi * db * ea))
    empty = n == 0
    return np.where(empty, -1.0, np.clip(low, -1.0, 1.0)), np.where(empty, 1.0, np.clip(high, -1.0, 1.0))


def newcombe_paired_interval(
    both: int, only_a: int, only_b: int, neither: int, *, confidence: float = 0.95, two_sided: bool = False
) -> tuple[float, float]:
    """Newcombe's hybrid score interval for ``p_a - p_b`` of paired binary outcomes.

    Newcombe (1998), "Improved confidence intervals for the difference between binomial proportions
    based on paired data", *Stat Med* 17:2635, method 10: ``L = d - sqrt(da^2 - 2 phi da eb + eb^2)``,
    ``U = d + sqrt(db^2 - 2 phi db ea + ea^2)`` where ``da = p_a - l_a``, ``ea = u_a - p_a`` (and so
    for b) come from the Wilson intervals of the two margins and ``phi`` estimates their correlation
    (Fagerland et al. 2014). Every pair counts as independent: with several samples per task the
    pairs are clustered and the gate takes the wider of this and the clustered bootstrap.

    Args:
        both: pairs where a and b both passed. only_a: a passed, b failed. only_b: b passed, a
            failed. neither: both failed.
        confidence: confidence level; each bound is one-sided at ``confidence`` unless ``two_sided``.

    Returns:
        ``(low, high)`` in [-1, 1]; ``(-1.0, 1.0)`` when there is no pair.

    Raises:
        ValueError: a negative count.
    """
    if min(both, only_a, only_b, neither) < 0:
        raise ValueError(f"negative count in ({both}, {only_a}, {only_b}, {neither})")
    z = float(stats.norm.ppf(1 - _tail(confidence, two_sided)))
    low, high = newcombe_paired_arrays(np.array([both]), np.array([only_a]), np.array([only_b]), np.array([neither]), z)
    return float(low[0]) + 0.0, float(high[0]) + 0.0


def paired_bootstrap_interval(
    task_ids: Sequence[str],
    diffs: Sequence[float],
    *,
    confidence: float = 0.95,
    two_sided: bool = False,
    resamples: int = 10_000,
    seed: int | np.random.SeedSequence = 0,
) -> tuple[float, float]:
    """Percentile interval of the mean paired difference, resampling tasks (clusters).

    The statistic is the mean over tasks of each task's mean paired difference over its samples
    (with ``k`` samples on every task: the mean over all pairs, i.e. the difference of pass@1). A
    replicate draws tasks with replacement, all of a task's samples together, so ``k`` samples per
    task shrink the within-task part of the variance by ``1/k`` and the interval narrows with ``k``
    while the between-task part is still counted.

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
    per_task = np.array([(sums[t] / counts[t], 1.0) for t in sums], dtype=np.float64)  # [tasks, (mean, 1)]
    if not per_task[:, 0].any():  # no discordant pair anywhere: every replicate is exactly 0
        return 0.0, 0.0
    return _cluster_percentile_interval(
        per_task,
        lambda tot: tot[:, 0] / tot[:, 1],
        confidence=confidence,
        two_sided=two_sided,
        resamples=resamples,
        seed=seed,
    )


def _cluster_percentile_interval(
    per_task: np.ndarray,
    statistic: Callable[[np.ndarray], np.ndarray],
    *,
    confidence: float,
    two_sided: bool,
    resamples: int,
    seed: int | np.random.SeedSequence,
) -> tuple[float, float]:
    """Percentile interval of ``statistic`` over a task-cluster bootstrap: each replicate draws the
    tasks with replacement and totals their rows of ``per_task`` (``[tasks, k]``
    per-task sums); ``statistic`` maps replicate totals ``[B, k]`` to ``[B]`` values."""
    rng = np.random.default_rng(seed)
    n_tasks = len(per_task)
    out = np.empty(resamples)
    chunk = max(1, 1_000_000 // n_tasks)  # bound memory of the B x T x k gather
    for start in range(0, resamples, chunk):
        b = min(chunk, resamples - start)
        drawn = rng.integers(0, n_tasks, size=(b, n_tasks))  # T tasks drawn with replacement per replicate
        out[start : start + b] = statistic(per_task[drawn].sum(axis=1))
    tail = _tail(confidence, two_sided)
    low, high = np.quantile(out, [tail, 1 - tail])
    return float(low) + 0.0, float(high) + 0.0  # + 0.0: no "-0" in messages


def mcnemar_exact_interval(
    b: int, c: int, n: int, *, confidence: float = 0.95, two_sided: bool = False
) -> tuple[float, float]:
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


@dataclass(frozen=True)
class ClusteredEstimate:
    """A ratio metric (or a paired difference of two) with its cluster-robust interval.

    Attributes:
        value: the point estimate, in the metric's unit.
        low, high: the interval's bounds (each a ``tail`` quantile: one-sided or half of it).
        se: delta-method standard error.
        clusters: clusters that entered (``G``).
    """

    value: float
    low: float
    high: float
    se: float
    clusters: int


def _cluster_totals(cluster_ids: Sequence[Hashable], columns: Sequence[Sequence[float]]) -> np.ndarray:
    """``[G, k]`` sums of each of the ``k`` columns over the units of each cluster."""
    if any(len(c) != len(cluster_ids) for c in columns):
        raise ValueError("every column needs one value per unit")
    index: dict[Hashable, int] = {}
    rows = [index.setdefault(c, len(index)) for c in cluster_ids]
    totals = np.zeros((len(index), len(columns)), dtype=np.float64)
    np.add.at(totals, np.array(rows, dtype=np.int64), np.array(columns, dtype=np.float64).T)
    return totals


def _t_interval(value: float, influence: np.ndarray, confidence: float, two_sided: bool) -> ClusteredEstimate | None:
    """``value`` with the CR1 delta-method variance ``G/(G-1) * sum(u^2) / G^2`` of the per-cluster
    influence ``u`` ``[G]`` and Student-t bounds on ``G - 1`` degrees of freedom."""
    g = len(influence)
    if g < 2:
        return None
    se = math.sqrt(g / (g - 1) * float(np.sum(influence**2)) / g**2)
    t = float(stats.t.ppf(1 - _tail(confidence, two_sided), g - 1))
    return ClusteredEstimate(value=value + 0.0, low=value - t * se + 0.0, high=value + t * se + 0.0, se=se, clusters=g)


def clustered_ratio_interval(
    cluster_ids: Sequence[Hashable],
    numerators: Sequence[float],
    denominators: Sequence[float],
    *,
    confidence: float = 0.95,
    two_sided: bool = True,
) -> ClusteredEstimate | None:
    """``R = sum X / sum Y`` with its cluster-robust delta-method interval (module docstring).

    Args:
        cluster_ids: ``[n]`` cluster of each unit (e.g. the task of each session).
        numerators, denominators: ``[n]`` each unit's ``X`` and ``Y`` (``Y = 1`` for a plain mean).
        confidence: level; each bound is the ``1 - confidence`` (one-sided) or half of it quantile.

    Returns:
        The estimate, or None when undefined: fewer than two clusters or ``sum Y == 0``.

    Raises:
        ValueError: lengths differ.
    """
    tot = _cluster_totals(cluster_ids, [numerators, denominators])
    if not len(tot) or tot[:, 1].sum() <= 0:
        return None
    r = tot[:, 0].sum() / tot[:, 1].sum()
    influence = (tot[:, 0] - r * tot[:, 1]) / tot[:, 1].mean()
    return _t_interval(float(r), influence, confidence, two_sided)


def paired_ratio_diff_interval(
    cluster_ids: Sequence[Hashable],
    numerators_a: Sequence[float],
    denominators_a: Sequence[float],
    numerators_b: Sequence[float],
    denominators_b: Sequence[float],
    *,
    confidence: float = 0.95,
    two_sided: bool = True,
) -> ClusteredEstimate | None:
    """``R_a - R_b`` of one ratio metric measured on both arms of the same units (pairs), with its
    cluster-robust delta-method interval.

    Each cluster's influence is ``(A_i - R_a B_i) / mean(B) - (C_i - R_b D_i) / mean(D)`` over its
    sums ``A, B`` (arm a) and ``C, D`` (arm b), so a cluster that moves both arms alike adds no
    variance: the pairing's covariance is in the estimate (Deng et al. 2018, section 3).

    Args:
        cluster_ids: ``[n]`` cluster of each pair (the task).
        numerators_a, denominators_a, numerators_b, denominators_b: ``[n]`` each pair's ``X`` and
            ``Y`` on arm a and on arm b.
        confidence, two_sided: as :func:`clustered_ratio_interval`.

    Returns:
        The difference and its interval, or None when undefined: fewer than two clusters, or an
        arm whose denominators sum to 0.

    Raises:
        ValueError: lengths differ.
    """
    tot = _cluster_totals(cluster_ids, [numerators_a, denominators_a, numerators_b, denominators_b])
    if not len(tot) or tot[:, 1].sum() <= 0 or tot[:, 3].sum() <= 0:
        return None
    ra = tot[:, 0].sum() / tot[:, 1].sum()
    rb = tot[:, 2].sum() / tot[:, 3].sum()
    influence = (tot[:, 0] - ra * tot[:, 1]) / tot[:, 1].mean() - (tot[:, 2] - rb * tot[:, 3]) / tot[:, 3].mean()
    return _t_interval(float(ra - rb), influence, confidence, two_sided)

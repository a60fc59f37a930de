"""Suite floors: the lowest pass rate the gate lets a candidate have, derived from a checkpoint's
measured outcomes (pure: no DB, no IO).

Invariant: a floor is a backstop below the non-inferiority test, never a second test of it. It is
the largest multiple of :data:`FLOOR_STEP` that is

1. at or below the one-sided ``confidence`` Wilson lower bound of the measured pass rate, on the
   effective sample size ``n / deff`` (``deff`` >= 1, the design effect of the suite's clusters:
   the CR1 cluster-robust variance over the binomial one; Kish 1965, *Survey Sampling*), and
2. refused to an *equal* candidate at most ``1 - confidence`` of the time: a candidate whose pass
   count is ``Binomial(floor(n / deff), measured rate)`` scores below it with probability
   ``<= 1 - confidence`` (exact binomial tail; :func:`equal_refusal`).

The Wilson bound alone does not give 2: below a rate of 0.5 it sits nearer the measured rate than
the binomial tail does (19/112: its 99 % bound 0.103 rounds to 0.10, which refuses 2.4 % of equal
candidates), and at small counts any floor above 0 refuses an equal candidate that scores 0. So the
floor steps down from the bound until 2 holds. A measured rate of 0 gives a floor of 0.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

from scipy import stats

from app.core.intervals import clustered_ratio_interval, wilson_lower

FLOOR_STEP = 0.005
"""Floors are multiples of this (half a point), rounded down."""

_STEPS_PER_UNIT = round(1 / FLOOR_STEP)


@dataclass(frozen=True)
class FloorEstimate:
    """A floor derived from one checkpoint's outcomes on one suite.

    Attributes:
        passed, n: passed outcomes and all outcomes (an errored sample counts as not passed).
        rate: ``passed / n``.
        clusters: distinct clusters among the outcomes (``n`` when each outcome is its own).
        design_effect: CR1 cluster-robust variance of the rate over the binomial ``rate (1 - rate)
            / n``, at least 1 (1 where every cluster holds one outcome, or the rate is 0 or 1).
        n_effective: ``n / design_effect``.
        lower_bound: the one-sided ``confidence`` Wilson lower bound on ``n_effective``.
        floor: the floor (module docstring), a multiple of :data:`FLOOR_STEP` in [0, lower_bound].
        equal_refusal: probability that an equal candidate scores below ``floor``
            (:func:`equal_refusal`), at most ``1 - confidence``.
        confidence: the one-sided level of the bound.
    """

    passed: int
    n: int
    rate: float
    clusters: int
    design_effect: float
    n_effective: float
    lower_bound: float
    floor: float
    equal_refusal: float
    confidence: float


def round_down(value: float) -> float:
    """``value`` rounded down to a multiple of :data:`FLOOR_STEP` (3 decimals, no float residue)."""
    return round(math.floor(value * _STEPS_PER_UNIT + 1e-9) / _STEPS_PER_UNIT, 3)


def equal_refusal(floor: float, n: float, rate: float) -> float:
    """Probability that a candidate equal to the measured checkpoint is refused by ``floor``: its
    pass count ``X ~ Binomial(m, rate)``, ``m = floor(n)`` trials (``n`` may be an effective sample
    size), and the gate refuses ``X / m < floor`` (it passes ``rate >= floor``).

    Raises:
        ValueError: ``rate`` outside [0, 1].
    """
    if not 0.0 <= rate <= 1.0:
        raise ValueError(f"rate={rate} outside [0, 1]")
    m = max(1, math.floor(n + 1e-9))
    below = math.ceil(floor * m - 1e-9)  # X <= below - 1 is refused
    return float(stats.binom.cdf(below - 1, m, rate)) if below > 0 else 0.0


def design_effect(passed: Sequence[bool], clusters: Sequence[Hashable]) -> float:
    """Kish's design effect of a pass rate over clustered outcomes: the CR1 cluster-robust variance
    (:func:`app.core.intervals.clustered_ratio_interval`, delta method) over the binomial variance
    ``rate (1 - rate) / n``, floored at 1 (clustering never narrows the bound). 1 when every
    outcome is its own cluster, fewer than two clusters, or the rate is 0 or 1.

    Raises:
        ValueError: lengths differ.
    """
    if len(passed) != len(clusters):
        raise ValueError("one cluster per outcome")
    n = len(passed)
    rate = sum(passed) / n if n else 0.0
    if len(set(clusters)) in (0, 1, n) or rate in (0.0, 1.0):
        return 1.0
    est = clustered_ratio_interval(clusters, [float(p) for p in passed], [1.0] * n)
    if est is None:
        return 1.0
    return max(1.0, est.se**2 / (rate * (1 - rate) / n))


def derive_floor(
    passed: Sequence[bool], clusters: Sequence[Hashable] | None = None, *, confidence: float = 0.99
) -> FloorEstimate:
    """The floor for a suite from one checkpoint's outcomes on it (module docstring).

    Args:
        passed: ``[n]`` each (task, sample) outcome of the measured checkpoint.
        clusters: ``[n]`` each outcome's cluster (the gate's ``cluster_by``: a template or a task);
            None: each outcome is its own.
        confidence: one-sided level of the lower bound; ``1 - confidence`` also caps the equal
            candidate's refusal.

    Raises:
        ValueError: no outcomes, lengths differ, or ``confidence`` outside (0.5, 1).
    """
    n = len(passed)
    if n == 0:
        raise ValueError("no outcomes to derive a floor from")
    ids: Sequence[Hashable] = list(range(n)) if clusters is None else clusters
    k = sum(bool(p) for p in passed)
    rate = k / n
    deff = design_effect(passed, ids)
    n_eff = n / deff
    bound = wilson_lower(rate, n_eff, confidence)
    floor = round_down(bound)
    while floor > 0 and equal_refusal(floor, n_eff, rate) > 1 - confidence:
        floor = round_down(floor - FLOOR_STEP / 2)
    return FloorEstimate(
        passed=k,
        n=n,
        rate=rate,
        clusters=len(set(ids)),
        design_effect=deff,
        n_effective=n_eff,
        lower_bound=bound,
        floor=floor,
        equal_refusal=equal_refusal(floor, n_eff, rate),
        confidence=confidence,
    )

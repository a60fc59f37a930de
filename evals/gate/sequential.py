"""Anytime-valid confidence sequences for a paired difference bounded in [-1, 1].

Invariant: pure, deterministic functions of the observations in their order. At level ``alpha``
the lower sequence stays below the true mean at *every* look with probability at least
``1 - alpha`` (and the upper one above it), so the gate may look after every observation and stop
the first time a bound decides without inflating its error.

Two sequences, one-sided each:

- :func:`normal_mixture_confidence_sequence` (the gate's default): the asymptotic confidence
  sequence of Waudby-Smith, Arbour, Sinha, Kennedy & Ramdas (2024, "Time-uniform central limit
  theory and asymptotic confidence sequences", Ann. Statist. 52(6), Theorem 2.2): Robbins' normal
  mixture boundary with a plug-in variance,

      mu_t -/+ sigma_t sqrt( 2 (t rho^2 + 1) / (t^2 rho^2) log( sqrt(t rho^2 + 1) / alpha ) ),

  with ``rho^2 = (-2 log alpha + log(-2 log alpha + 1)) / t*`` tuned to be tightest at the planned
  number of observations ``t*`` (their eq. 2.8). Its two-sided form is used for each one-sided
  bound, which is conservative. ``sigma_t^2`` carries one pseudo-observation of variance
  :data:`PRIOR_VARIANCE` so that a run of identical differences does not collapse the bound, and no
  look is taken before ``burn_in`` observations (the guarantee is asymptotic).
- :func:`betting_confidence_sequence`: the exact betting sequence of Waudby-Smith & Ramdas (2024,
  "Estimating means of bounded random variables by betting", JRSSB 86(1):1-27, section 4). With
  ``x_i`` in [0, 1] and a candidate mean ``m``, the capital ``K_t^+(m) = prod (1 + lambda_i(m)
  (x_i - m))`` is a nonnegative martingale when the mean is ``m``, so by Ville's inequality it
  reaches ``1 / alpha`` with probability at most ``alpha``; ``{m : K_t^+(m) < 1/alpha}`` holds the
  mean at every t. Bets are predictable (their eq. 26): ``lambda_i = sqrt(2 log(1/alpha) /
  (sigma_{i-1}^2 i log(1 + i)))`` truncated at ``c / m``. It needs no variance assumption and holds
  at every n, and pays for that in width: at 21 clusters (the held-out suite's templates) its bounds
  are about +-20 points, where the normal mixture's are about +-6 on
  constructed tables of the held-out suite's 112 tasks (tests/unit/test_sequential.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

PRIOR_VARIANCE = 1 / 16
"""Variance of the normal mixture's one pseudo-observation (a cluster difference of +-1/4)."""
GRID = 4001
"""Candidate means on [0, 1] (a resolution of 0.0005, i.e. 0.1 points of the difference)."""
TRUNCATION = 0.5
"""``c`` of the truncated bets (Waudby-Smith & Ramdas suggest 1/2 or 3/4)."""


@dataclass(frozen=True)
class ConfidenceSequence:
    """Running one-sided bounds of a mean difference, one entry per observation.

    ``low[t]`` and ``high[t]`` (float64, shape ``[n]``, in [-1, 1]) are the bounds after
    observations ``0..t``, each the running intersection (so ``low`` never falls, ``high`` never
    rises)."""

    low: np.ndarray
    high: np.ndarray


def _lower_unit(x: np.ndarray, alpha: float, grid: np.ndarray) -> np.ndarray:
    """Running lower bounds of the mean of ``x`` (in [0, 1], shape [n]) from the betting CS."""
    i = np.arange(1, len(x) + 1)
    mu = (0.5 + np.cumsum(x)) / (i + 1)
    var = (0.25 + np.cumsum((x - mu) ** 2)) / (i + 1)
    var_prev = np.concatenate([[0.25], var[:-1]])  # predictable: only observations before i
    lam = np.sqrt(2 * np.log(1 / alpha) / (var_prev * i * np.log1p(i)))  # [n]
    bets = np.minimum(lam[:, None], TRUNCATION / np.maximum(grid[None, :], 1e-12))  # [n, G]
    log_capital = np.cumsum(np.log1p(bets * (x[:, None] - grid[None, :])), axis=0)  # [n, G]
    inside = log_capital < np.log(1 / alpha)  # [n, G]; capital falls as m rises, so a suffix of the grid
    first = np.where(inside.any(axis=1), inside.argmax(axis=1), len(grid) - 1)
    return np.maximum.accumulate(grid[first])


def betting_confidence_sequence(differences: np.ndarray, alpha: float = 0.05) -> ConfidenceSequence:
    """One-sided betting confidence sequences (level ``1 - alpha`` each) of the mean of
    ``differences``.

    Args:
        differences: float array ``[n]`` of paired differences in [-1, 1] (e.g. each template's
            mean of candidate - production pass indicators), in the order they were observed.
        alpha: error of each one-sided bound.

    Returns:
        The running lower and upper bounds (:class:`ConfidenceSequence`).

    Raises:
        ValueError: an empty input, a value outside [-1, 1], or ``alpha`` outside (0, 1).
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or len(d) == 0 or np.any(np.abs(d) > 1 + 1e-12) or not 0 < alpha < 1:
        raise ValueError(f"need a non-empty 1-d array in [-1, 1] and 0 < alpha < 1 (got shape {d.shape}, {alpha})")
    grid = np.linspace(0.0, 1.0, GRID)
    x = np.clip((d + 1) / 2, 0.0, 1.0)
    low = 2 * _lower_unit(x, alpha, grid) - 1
    high = 1 - 2 * _lower_unit(1 - x, alpha, grid)
    return ConfidenceSequence(low=low, high=high)


def normal_mixture_confidence_sequence(
    differences: np.ndarray, planned: int, alpha: float = 0.05, burn_in: int = 10
) -> ConfidenceSequence:
    """Asymptotic normal-mixture confidence sequences (level ``1 - alpha`` each) of the mean of
    ``differences``, tuned for ``planned`` observations.

    Args:
        differences: float array ``[n]`` of paired differences in [-1, 1], in observation order.
        planned: observations the run plans (``t*``), >= 1.
        alpha: error of each bound.
        burn_in: observations before the first look; earlier bounds are [-1, 1].

    Returns:
        The running lower and upper bounds (:class:`ConfidenceSequence`).

    Raises:
        ValueError: an empty input, a value outside [-1, 1], ``planned`` < 1 or ``alpha`` outside (0, 1).
    """
    d = np.asarray(differences, dtype=np.float64)
    if d.ndim != 1 or len(d) == 0 or np.any(np.abs(d) > 1 + 1e-12) or not 0 < alpha < 1 or planned < 1:
        raise ValueError(f"need a non-empty 1-d array in [-1, 1], planned >= 1 and 0 < alpha < 1 (got {d.shape})")
    t = np.arange(1, len(d) + 1)
    mu = np.cumsum(d) / t
    var = (PRIOR_VARIANCE + np.maximum(np.cumsum(d**2) - t * mu**2, 0.0)) / t
    rho2 = (-2 * np.log(alpha) + np.log(-2 * np.log(alpha) + 1)) / planned
    half = np.sqrt(var * 2 * (t * rho2 + 1) / (t**2 * rho2) * np.log(np.sqrt(t * rho2 + 1) / alpha))
    looked = t >= burn_in
    low = np.maximum.accumulate(np.where(looked, np.maximum(mu - half, -1.0), -1.0))
    high = np.minimum.accumulate(np.where(looked, np.minimum(mu + half, 1.0), 1.0))
    return ConfidenceSequence(low=low, high=high)

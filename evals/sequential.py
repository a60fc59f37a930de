"""An anytime-valid confidence sequence for a paired difference bounded in [-1, 1].

Invariant: a pure, deterministic function of the observations in their order. At level ``alpha``
the lower sequence is below the true mean at *every* time with probability at least
``1 - alpha`` (and so is the upper sequence above it), so the gate may look after every
observation and stop the first time a bound decides, without inflating its error.

The method is the hedged betting confidence sequence of Waudby-Smith & Ramdas (2024, "Estimating
means of bounded random variables by betting", JRSSB 86(1):1-27, section 4), one-sided. With
``x_i`` in [0, 1] and a candidate mean ``m``, the capital of a bettor that the mean exceeds ``m``,

    K_t^+(m) = prod_{i <= t} (1 + lambda_i(m) (x_i - m)),

is a nonnegative martingale when the mean is ``m``; by Ville's inequality it ever reaches
``1 / alpha`` with probability at most ``alpha``, so ``{m : K_t^+(m) < 1 / alpha}`` holds the mean
at every t: its infimum is the lower bound (and ``K_t^-`` with ``m - x_i`` gives the upper one).
The bets are predictable (their eq. 26, "PrPl"): ``lambda_i = sqrt(2 log(1/alpha) /
(sigma_{i-1}^2 i log(1 + i)))`` truncated at ``c / m`` (``c / (1 - m)`` for the upper bound), with
``sigma_i^2 = (1/4 + sum (x_j - mu_j)^2) / (i + 1)`` and ``mu_i = (1/2 + sum x_j) / (i + 1)``. It
needs no variance assumption and holds at every n; its price is width at small n (tens of
observations), where a fixed-n interval is narrower but valid only when looked at once.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

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

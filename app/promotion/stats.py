"""Binomial intervals for the eval report view (pure functions, no I/O).

The gate (``evals/``) decides; these intervals only let the release manager read a pass rate next to
production's with its uncertainty.
"""

from __future__ import annotations

import math

Z95 = 1.959963984540054


def wilson_interval(passed: int, n: int, z: float = Z95) -> tuple[float, float]:
    """Wilson score interval of a pass rate ``passed / n`` (Wilson 1927; Agresti & Coull 1998).

    Returns ``(low, high)`` in [0, 1]; ``(0.0, 1.0)`` when ``n == 0``.

    Raises:
        ValueError: ``passed`` outside ``[0, n]``.
    """
    if not 0 <= passed <= n:
        raise ValueError(f"passed={passed} outside [0, {n}]")
    if n == 0:
        return 0.0, 1.0
    p = passed / n
    denom = 1 + z * z / n
    center = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, center - half), min(1.0, center + half)


def newcombe_diff_interval(passed_a: int, n_a: int, passed_b: int, n_b: int,
                           z: float = Z95) -> tuple[float, float]:
    """Interval for the difference of two independent pass rates ``a - b``.

    Newcombe's hybrid score method (Newcombe 1998, "Interval estimation for the difference between
    independent proportions", method 10), built from the two Wilson intervals:
    ``L = d - sqrt((p_a - l_a)^2 + (u_b - p_b)^2)``, ``U = d + sqrt((u_a - p_a)^2 + (p_b - l_b)^2)``.
    Returns ``(-1.0, 1.0)`` if either sample is empty.
    """
    if n_a == 0 or n_b == 0:
        return -1.0, 1.0
    pa, pb = passed_a / n_a, passed_b / n_b
    la, ua = wilson_interval(passed_a, n_a, z)
    lb, ub = wilson_interval(passed_b, n_b, z)
    d = pa - pb
    return (max(-1.0, d - math.sqrt((pa - la) ** 2 + (ub - pb) ** 2)),
            min(1.0, d + math.sqrt((ua - pa) ** 2 + (pb - lb) ** 2)))

"""The gate's power at the n and base rate it observed: can this suite tell a regression apart?

Invariant: a pure, seeded function of (pairs, base rate, margin, confidence): the same inputs give
the same power, so a stored decision can be recomputed.

The gate's non-inferiority check passes a suite when the lower confidence bound of
pass@1(candidate) - pass@1(production) is above ``-margin``. Its power is the probability that it
passes a candidate exactly as good as production, i.e. that the data can tell such a candidate
from one ``margin`` worse (Blackwelder 1982, "Proving the null hypothesis in clinical trials",
*Controlled Clinical Trials* 3:345; Nam 1997, *Biometrics* 53:1422, for matched pairs). Under the
normal approximation it equals the probability that the upper bound falls below 0 when the
candidate really is ``margin`` worse: ``Phi(margin / se - z)`` either way, the one number that says
whether the suite is big enough for the margin (docs/gate.md).

Model: ``n`` independent pairs, both sides passing with production's observed rate ``p``
independently, so a pair is discordant with probability ``2 p (1 - p)``; each simulated table goes
through the gate's interval (:func:`app.core.intervals.newcombe_paired_arrays`). Greedy decoding
and tasks of unequal difficulty make real pairs agree more often than that, so this is the
conservative case, the one ``bench/gate_power.py`` simulates too. A rate of exactly 0 or 1 is taken
at its word: every simulated pair agrees, and the power is whether n pairs of agreement are enough
to bound the difference above ``-margin`` (about ``n > z^2 / margin``).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
from scipy import stats

from app.core.intervals import newcombe_paired_arrays

DEFAULT_SIMS = 20_000
"""Simulated tables per power figure: Monte Carlo standard error at most 0.0035 (0.0028 at 0.8)."""


@lru_cache(maxsize=4096)
def non_inferiority_power(
    n: int,
    base_rate: float,
    margin: float,
    *,
    confidence: float = 0.95,
    two_sided: bool = False,
    sims: int = DEFAULT_SIMS,
    seed: int = 0,
) -> float:
    """Probability that the gate's lower bound clears ``-margin`` for an equal candidate.

    Args:
        n: paired outcomes.
        base_rate: production's pass rate in [0, 1] (shared by the equal candidate).
        margin: the suite's non-inferiority margin (pass-rate fraction, 0.045 = 4.5 points).
        confidence: the gate's confidence; the bound is one-sided unless ``two_sided``.
        sims: simulated tables.
        seed: generator seed.

    Returns:
        Power in [0, 1]; 0.0 when ``n`` is 0.

    Raises:
        ValueError: ``base_rate`` outside [0, 1], negative ``n`` or ``margin``, or ``sims`` < 1.
    """
    if not 0.0 <= base_rate <= 1.0 or n < 0 or margin < 0 or sims < 1:
        raise ValueError(f"invalid power inputs n={n} base_rate={base_rate} margin={margin} sims={sims}")
    if n == 0:
        return 0.0
    tail = (1 - confidence) / 2 if two_sided else 1 - confidence
    z = float(stats.norm.ppf(1 - tail))
    p = base_rate
    rng = np.random.default_rng(seed)
    cells = rng.multinomial(n, [p * p, p * (1 - p), (1 - p) * p, (1 - p) * (1 - p)], size=sims)  # [sims, 4]
    low, _ = newcombe_paired_arrays(cells[:, 0], cells[:, 1], cells[:, 2], cells[:, 3], z)
    return float(np.mean(low > -margin))

"""Online product signals as ratio metrics with per-user clustered intervals (pure, no I/O).

Each signal is a ratio ``R = sum_i X_i / sum_i Y_i`` over the sessions ``i`` served by one
checkpoint (for example accepted edits / decided edits). Sessions of one user are correlated, and
the canary is randomised by user (``app.lifecycle.assignment``), so the user is the independent
unit: with ``S_u``, ``N_u`` the sums of ``X`` and ``Y`` over user ``u``'s sessions and ``K`` users,
the delta method gives (Deng, Knoblich, Lu 2018, "Applying the Delta Method in Metric Analytics",
arXiv 1803.06336, section 3; equal to the CR1 cluster-robust variance of a ratio):

    Var(R) ~= K / (K - 1) * sum_u (S_u - R * N_u)^2 / (sum_u N_u)^2

A naive per-session variance understates the error when users differ. The canary and production
arms hold disjoint users, so the difference ``R_canary - R_production`` has variance
``Var_c + Var_p`` and a normal interval ``diff +- z * sqrt(Var_c + Var_p)``.

Invariant: a signal is only reported where it is defined (two or more users and a positive
denominator on its side); the policy treats an undefined or under-sampled comparison as a
failure (fail closed), never as a pass.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from statistics import NormalDist
from typing import Any

#: name -> (unit, True when higher is better)
SIGNALS: dict[str, tuple[str, bool]] = {
    "edit_acceptance": ("accepted / decided edits", True),
    "edit_persistence": ("mean fraction of an accepted edit still present", True),
    "dissatisfied_followup_rate": ("dissatisfied follow-ups per session", False),
    "latency_per_token": ("serving seconds per completion token", False),
    "mean_reward": ("reward per labeled session", True),
}


@dataclass(frozen=True)
class SessionSignals:
    """The raw signals of one finalized session (trajectory), as the projection stored them.

    Attributes:
        user_id: pseudonymous user (the cluster).
        accepted, rejected: edits whose last decision was accept / reject.
        persisted_sum, persisted_n: sum and count of measured persistence fractions (0..1) of
            accepted edits.
        dissatisfied: dissatisfied follow-ups of the session.
        latency_s: total serving latency, seconds.
        completion_tokens: the model's tokens over the session.
        reward: the session's reward label (None when unlabeled).
    """

    user_id: str
    accepted: int = 0
    rejected: int = 0
    persisted_sum: float = 0.0
    persisted_n: int = 0
    dissatisfied: int = 0
    latency_s: float = 0.0
    completion_tokens: int = 0
    reward: float | None = None

    @classmethod
    def from_projection(
        cls, user_id: str, signals: dict[str, Any], completion_tokens: int, reward: float | None
    ) -> "SessionSignals":
        """From a trajectory's ``signals`` JSON (``consumers.projection``) and its label."""
        edits = (signals or {}).get("edits", {}) or {}
        accepted = [e for e in edits.values() if e.get("decision") == "accepted"]
        measured = [float(e["persisted"]) for e in accepted if e.get("persisted") is not None]
        return cls(
            user_id=user_id,
            accepted=len(accepted),
            rejected=sum(1 for e in edits.values() if e.get("decision") == "rejected"),
            persisted_sum=sum(measured),
            persisted_n=len(measured),
            dissatisfied=int(signals.get("dissatisfied_followups", 0) or 0),
            latency_s=float(signals.get("latency_s", 0.0) or 0.0),
            completion_tokens=int(completion_tokens),
            reward=reward,
        )

    def parts(self, signal: str) -> tuple[float, float]:
        """``(X, Y)``: this session's numerator and denominator of ``signal``.

        Raises:
            KeyError: unknown signal.
        """
        if signal == "edit_acceptance":
            return float(self.accepted), float(self.accepted + self.rejected)
        if signal == "edit_persistence":
            return self.persisted_sum, float(self.persisted_n)
        if signal == "dissatisfied_followup_rate":
            return float(self.dissatisfied), 1.0
        if signal == "latency_per_token":
            return self.latency_s, float(self.completion_tokens)
        if signal == "mean_reward":
            return (self.reward, 1.0) if self.reward is not None else (0.0, 0.0)
        raise KeyError(f"unknown online signal {signal!r}; expected one of {', '.join(SIGNALS)}")


@dataclass(frozen=True)
class RatioEstimate:
    """A ratio metric over one arm: value, delta-method standard error, and its sample."""

    value: float
    se: float
    users: int
    sessions: int
    denominator: float


def ratio_estimate(sessions: Sequence[SessionSignals], signal: str) -> RatioEstimate | None:
    """``R = sum X / sum Y`` with the per-user clustered delta-method standard error (module docstring).

    Returns None when the signal is undefined: fewer than two users with a positive denominator
    sum, or ``sum Y == 0``. Sessions whose denominator is 0 (no decided edit, no label) do not count.
    """
    per_user: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    counted = 0
    for s in sessions:
        x, y = s.parts(signal)
        if y <= 0:
            continue
        acc = per_user[s.user_id]
        acc[0] += x
        acc[1] += y
        counted += 1
    k = len(per_user)
    total_y = sum(n for _, n in per_user.values())
    if k < 2 or total_y <= 0:
        return None
    r = sum(sx for sx, _ in per_user.values()) / total_y
    resid = sum((sx - r * n) ** 2 for sx, n in per_user.values())
    var = k / (k - 1) * resid / total_y**2
    return RatioEstimate(value=r, se=math.sqrt(var), users=k, sessions=counted, denominator=total_y)


def z_for(confidence: float) -> float:
    """Two-sided normal quantile: 1.96 at 0.95."""
    return NormalDist().inv_cdf(0.5 + confidence / 2)


@dataclass(frozen=True)
class SignalDiff:
    """``canary - production`` of one signal with its interval; ``regressed`` when the whole
    interval lies on the bad side of 0."""

    signal: str
    canary: RatioEstimate | None
    production: RatioEstimate | None
    diff: float | None = None
    low: float | None = None
    high: float | None = None
    regressed: bool = False
    higher_is_better: bool = True


def compare_signal(
    canary: Sequence[SessionSignals], production: Sequence[SessionSignals], signal: str, confidence: float = 0.95
) -> SignalDiff:
    """The difference of ``signal`` between the arms with a ``confidence`` normal interval on the
    summed clustered variances (independent arms: disjoint users)."""
    better_up = SIGNALS[signal][1]
    c, p = ratio_estimate(canary, signal), ratio_estimate(production, signal)
    if c is None or p is None:
        return SignalDiff(signal=signal, canary=c, production=p, higher_is_better=better_up)
    d = c.value - p.value
    half = z_for(confidence) * math.sqrt(c.se**2 + p.se**2)
    lo, hi = d - half, d + half
    regressed = hi < 0 if better_up else lo > 0
    return SignalDiff(
        signal=signal, canary=c, production=p, diff=d, low=lo, high=hi, regressed=regressed, higher_is_better=better_up
    )


@dataclass(frozen=True)
class OnlinePolicy:
    """The resolved ``[online]`` gate setting (``evals.gate.policy.OnlinePolicy`` validates the TOML;
    the gate decision stores it resolved, and promotion reads it from there)."""

    required: bool = False
    min_sessions: int = 100
    signals: tuple[str, ...] = tuple(SIGNALS)
    confidence: float = 0.95

    @classmethod
    def from_config(cls, config: dict[str, Any] | None) -> "OnlinePolicy":
        """From a stored gate config's ``online`` table (absent: not required)."""
        online = (config or {}).get("online") or {}
        return cls(
            required=bool(online.get("required", False)),
            min_sessions=int(online.get("min_sessions", cls.min_sessions)),
            signals=tuple(online.get("signals") or SIGNALS),
            confidence=float(online.get("confidence", cls.confidence)),
        )


@dataclass
class Comparison:
    """Canary versus production over one window: sessions per arm, every signal's difference."""

    canary_sessions: int
    production_sessions: int
    diffs: dict[str, SignalDiff] = field(default_factory=dict)


def compare_arms(
    canary: Sequence[SessionSignals],
    production: Sequence[SessionSignals],
    signals: Iterable[str] = SIGNALS,
    confidence: float = 0.95,
) -> Comparison:
    """Every signal's difference between the two arms."""
    return Comparison(
        canary_sessions=len(canary),
        production_sessions=len(production),
        diffs={s: compare_signal(canary, production, s, confidence) for s in signals},
    )


def policy_reasons(comparison: Comparison, policy: OnlinePolicy) -> list[str]:
    """Every reason the online policy refuses (empty: no signal regressed significantly and there
    are enough sessions on both arms). Fails closed on too few sessions and on undefined signals."""
    reasons: list[str] = []
    for arm, n in (("canary", comparison.canary_sessions), ("production", comparison.production_sessions)):
        if n < policy.min_sessions:
            reasons.append(f"too few {arm} sessions for the online policy: {n} < {policy.min_sessions}")
    for name in policy.signals:
        d = comparison.diffs.get(name)
        if d is None or d.diff is None:
            reasons.append(f"online signal {name} cannot be compared yet (no data on one arm)")
        elif d.regressed:
            reasons.append(
                f"online signal {name} regressed: canary - production = {d.diff:+.4g} "
                f"({policy.confidence:.0%} CI {d.low:+.4g}..{d.high:+.4g}, clustered by user)"
            )
    return reasons

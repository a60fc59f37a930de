"""Online signals with per-user clustered intervals, against a hand-computed example, and the
sticky canary assignment."""

from __future__ import annotations

import hashlib
import math

import pytest

from app.lifecycle.assignment import assign_arm, user_bucket
from app.lifecycle.online_stats import (
    Comparison,
    OnlinePolicy,
    SessionSignals,
    compare_arms,
    compare_signal,
    policy_reasons,
    ratio_estimate,
)


def _edits(user: str, accepted: int, rejected: int) -> SessionSignals:
    return SessionSignals(user_id=user, accepted=accepted, rejected=rejected)


# Edit acceptance = accepted / decided edits. Canary arm: three users, five sessions.
CANARY = [_edits("u1", 1, 1), _edits("u1", 1, 0), _edits("u2", 0, 1), _edits("u3", 2, 0), _edits("u3", 1, 1)]
# Production arm: four users, five sessions.
PRODUCTION = [_edits("p1", 1, 0), _edits("p1", 1, 0), _edits("p2", 1, 1), _edits("p3", 0, 2), _edits("p4", 3, 0)]


def test_clustered_ratio_matches_the_hand_computed_delta_method():
    # Canary per user (S_u, N_u): u1 (2, 3), u2 (0, 1), u3 (3, 4); R = 5/8.
    # residuals S_u - R N_u: 0.125, -0.625, 0.5 -> squares sum 0.65625;
    # Var = K/(K-1) * 0.65625 / 8^2 = 1.5 * 0.65625 / 64 = 0.015380859375.
    c = ratio_estimate(CANARY, "edit_acceptance")
    assert c.value == pytest.approx(0.625)
    assert c.se**2 == pytest.approx(0.015380859375)
    assert (c.users, c.sessions, c.denominator) == (3, 5, 8)
    # Production per user: p1 (2, 2), p2 (1, 2), p3 (0, 2), p4 (3, 3); R = 6/9 = 2/3.
    # residuals: 2/3, -1/3, -4/3, 1 -> squares sum 4/9 + 1/9 + 16/9 + 1 = 10/3;
    # Var = 4/3 * (10/3) / 81 = 40/729.
    p = ratio_estimate(PRODUCTION, "edit_acceptance")
    assert p.value == pytest.approx(2 / 3)
    assert p.se**2 == pytest.approx(40 / 729)
    # canary - production = 5/8 - 2/3 = -1/24, 95 % interval +- 1.959964 * sqrt(0.015380859375 + 40/729)
    d = compare_signal(CANARY, PRODUCTION, "edit_acceptance")
    half = 1.959963984540054 * math.sqrt(0.015380859375 + 40 / 729)
    assert d.diff == pytest.approx(-1 / 24)
    assert (d.low, d.high) == (pytest.approx(-1 / 24 - half), pytest.approx(-1 / 24 + half))
    assert half == pytest.approx(0.51948, abs=1e-4) and not d.regressed


def test_clustering_widens_the_interval_when_a_users_sessions_agree():
    # One user accepts everything in 20 sessions, another rejects everything in 20: per session the
    # sample looks like 40 independent coin flips, but there are only two independent users.
    sessions = [_edits("a", 1, 0)] * 20 + [_edits("b", 0, 1)] * 20
    est = ratio_estimate(sessions, "edit_acceptance")
    naive_se = math.sqrt(0.5 * 0.5 / 40)
    assert est.value == pytest.approx(0.5)
    assert est.se > 4 * naive_se  # clustered: sqrt(2 * (0.5^2 * 20^2 * 2) / 40^2) = 0.5


def test_undefined_signals_and_single_users_are_not_reported():
    assert ratio_estimate([_edits("u1", 1, 0), _edits("u1", 0, 1)], "edit_acceptance") is None  # one user
    assert ratio_estimate([_edits("u1", 0, 0), _edits("u2", 0, 0)], "edit_acceptance") is None  # no decided edit
    assert ratio_estimate([SessionSignals("u1"), SessionSignals("u2")], "mean_reward") is None  # unlabeled
    with pytest.raises(KeyError):
        SessionSignals("u1").parts("vibes")


def _latency(user: str, seconds: float, tokens: int = 100) -> SessionSignals:
    return SessionSignals(user_id=user, latency_s=seconds, completion_tokens=tokens, reward=0.0)


def test_a_significant_regression_is_flagged_in_the_bad_direction_only():
    slow = [_latency(f"c{i}", 20.0 + i % 3) for i in range(30)]
    fast = [_latency(f"p{i}", 10.0 + i % 3) for i in range(30)]
    worse = compare_signal(slow, fast, "latency_per_token")  # lower is better: canary slower
    assert worse.low > 0 and worse.regressed
    better = compare_signal(fast, slow, "latency_per_token")
    assert better.high < 0 and not better.regressed


def test_policy_fails_closed_on_too_few_sessions_and_on_missing_data():
    policy = OnlinePolicy(required=True, min_sessions=10, signals=("edit_acceptance", "latency_per_token"))
    few = compare_arms(CANARY, PRODUCTION, policy.signals)
    reasons = policy_reasons(few, policy)
    assert "too few canary sessions for the online policy: 5 < 10" in reasons
    assert "too few production sessions for the online policy: 5 < 10" in reasons
    assert any("latency_per_token cannot be compared yet" in r for r in reasons)  # no tokens on either arm
    enough = compare_arms(CANARY * 2, PRODUCTION * 2, ("edit_acceptance",))
    assert policy_reasons(enough, OnlinePolicy(required=True, min_sessions=10, signals=("edit_acceptance",))) == []
    assert policy_reasons(Comparison(0, 0), OnlinePolicy(min_sessions=1, signals=())) != []


def test_policy_from_a_stored_gate_config():
    assert OnlinePolicy.from_config({"policy": "no-regression@1"}).required is False
    p = OnlinePolicy.from_config({"online": {"required": True, "min_sessions": 40, "signals": ["mean_reward"]}})
    assert (p.required, p.min_sessions, p.signals) == (True, 40, ("mean_reward",))


def test_assignment_is_sticky_stable_and_near_the_fraction():
    # The bucket is sha256(canary_id \0 user_id)'s first 8 bytes over 2^64: stable across processes.
    expected = int.from_bytes(hashlib.sha256(b"c-1\x00user-007").digest()[:8], "big") / 2**64
    assert user_bucket("user-007", "c-1") == expected
    arms = [assign_arm(f"user-{i}", "c-1", 0.1) for i in range(20_000)]
    assert arms == [assign_arm(f"user-{i}", "c-1", 0.1) for i in range(20_000)]  # sticky
    share = arms.count("canary") / len(arms)
    assert abs(share - 0.1) < 4 * math.sqrt(0.1 * 0.9 / len(arms))
    # growing the fraction only adds users to the canary; another canary draws another split
    grown = [assign_arm(f"user-{i}", "c-1", 0.2) for i in range(20_000)]
    assert all(g == "canary" for a, g in zip(arms, grown) if a == "canary")
    other = [assign_arm(f"user-{i}", "c-2", 0.1) for i in range(20_000)]
    assert other != arms
    assert assign_arm("u", "c", 0.0) == "production" and assign_arm("u", "c", 1.0) == "canary"
    with pytest.raises(ValueError):
        assign_arm("u", "c", 1.5)


def test_the_gate_config_online_setting_and_the_promotion_side_agree():
    from app.lifecycle.online_stats import SIGNALS
    from evals.gate.policy import ONLINE_SIGNALS, load_gate_config
    from evals.gate.policy import OnlinePolicy as OnlineSetting

    assert set(ONLINE_SIGNALS) == set(SIGNALS)
    shipped = load_gate_config()
    resolved = OnlinePolicy.from_config(shipped.model_dump(mode="json"))
    assert resolved.required is shipped.online.required and resolved.min_sessions == shipped.online.min_sessions
    assert resolved.signals == tuple(shipped.online.signals)
    with pytest.raises(ValueError):
        OnlineSetting(signals=["vibes"])
    with pytest.raises(ValueError):
        OnlineSetting(min_sessions=1)

"""The canary policy that acts on the online signals (behind the Celery beat task
``flywheel.promotion.evaluate_canary`` and ``flywheel canary evaluate``).

The policy is the canary's gate decision's resolved ``[online]`` setting
(:class:`app.lifecycle.online_stats.OnlinePolicy`: signals, confidence, ``min_sessions``; its
defaults when the gate stored none), applied to canary minus production over the canary's window
(:func:`app.lifecycle.online.compare_canary`). ``min_sessions`` on each arm is the canary's planned
size.

Invariants:

- an evaluation takes the production advisory lock and locks the active canary ``FOR UPDATE``
  (the locks of every canary and production change), so concurrent runs (beat, a second worker,
  the CLI) act once: a later run finds the canary stopped or already marked;
- a canary with a policy signal regressed (its whole interval on the bad side of 0) is stopped
  through :func:`app.lifecycle.canary.stop_canary` by ``POLICY_ACTOR``: audited, announced as
  ``canary.stopped``, which the serving watcher follows, so its users return to production; the
  stop reason names every regressed signal with its interval;
- a canary with ``min_sessions`` on both arms, every policy signal defined and none regressed is
  marked ready once: an audit entry ``canary.ready`` (the comparison in its details) that the API
  shows as the canary's ``ready_at``; it keeps serving until a release manager promotes it, and a
  later regression still ends it;
- anything else writes nothing.

Each evaluation is a new look at a fixed-confidence interval, so over many looks an equal canary is
ended more often than ``1 - confidence``. Ending is the safe error (its users go back to the
production they had), so the policy accepts it rather than let a regression serve.

Functions flush and never commit.
"""

from __future__ import annotations

import uuid
from collections.abc import Collection
from dataclasses import asdict, dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.core.telemetry import traced
from app.lifecycle.canary import get_active_canary, stop_canary
from app.lifecycle.online import compare_canary
from app.lifecycle.online_stats import Comparison, OnlinePolicy, policy_reasons
from app.lifecycle.production import lock_production
from app.models import Canary, GateDecision
from app.repositories.audit import record_audit

POLICY_ACTOR = "policy:canary"
READY_ACTION = "canary.ready"


@dataclass
class CanaryEvaluation:
    """What one evaluation found and did.

    Attributes:
        outcome: ``no_canary`` | ``ended`` (regressed, stopped) | ``ready`` (marked now) |
            ``already_ready`` | ``waiting`` (too few sessions or a signal not comparable yet).
        reasons: why (the regressions, or what it waits for); empty when ready.
    """

    outcome: str
    canary_id: str | None = None
    checkpoint_id: str | None = None
    canary_sessions: int = 0
    production_sessions: int = 0
    reasons: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return asdict(self)


def canary_policy(session: Session, canary: Canary) -> OnlinePolicy:
    """The ``[online]`` policy stored with the canary's gate decision (defaults without one)."""
    gate = session.get(GateDecision, canary.gate_decision_id) if canary.gate_decision_id else None
    return OnlinePolicy.from_config((gate.report or {}).get("config") if gate else None)


def ready_times(session: Session, canary_ids: Collection[uuid.UUID | str]) -> dict[str, datetime]:
    """``{canary id: when the policy marked it ready}`` for those it marked."""
    if not canary_ids:
        return {}
    rows = session.execute(
        text(
            "SELECT details->>'canary_id', min(created_at) FROM audit_log "
            "WHERE action = :action AND details->>'canary_id' = ANY(:ids) GROUP BY 1"
        ),
        {"action": READY_ACTION, "ids": [str(i) for i in canary_ids]},
    ).all()
    return dict(rows)


def _regressions(comparison: Comparison, policy: OnlinePolicy) -> list[str]:
    return [
        f"online signal {name} regressed: canary - production = {d.diff:+.4g} "
        f"({policy.confidence:.0%} CI {d.low:+.4g}..{d.high:+.4g}, clustered by user)"
        for name in policy.signals
        if (d := comparison.diffs.get(name)) is not None and d.regressed
    ]


@traced("canary.evaluate", attrs=("actor",))
def evaluate_canary(session: Session, *, actor: str = POLICY_ACTOR) -> CanaryEvaluation:
    """Apply the policy to the active canary: end it on a regression, mark it ready when it ran its
    planned size without one (see the module invariants). Idempotent.

    Raises:
        sqlalchemy.exc.DBAPIError: database faults (nothing is written).
    """
    lock_production(session)
    canary = get_active_canary(session, for_update=True)
    if canary is None:
        return CanaryEvaluation(outcome="no_canary")
    policy = canary_policy(session, canary)
    comparison = compare_canary(session, canary, policy)
    out = CanaryEvaluation(
        outcome="waiting",
        canary_id=str(canary.id),
        checkpoint_id=canary.checkpoint_id,
        canary_sessions=comparison.canary_sessions,
        production_sessions=comparison.production_sessions,
    )
    regressed = _regressions(comparison, policy)
    if regressed:
        out.outcome, out.reasons = "ended", regressed
        stop_canary(
            session,
            actor=actor,
            reason="the canary policy ended it: " + "; ".join(regressed),
            canary_id=canary.id,
        )
        return out
    out.reasons = policy_reasons(comparison, policy)
    if out.reasons:
        return out
    if ready_times(session, [canary.id]):
        out.outcome = "already_ready"
        return out
    out.outcome = "ready"
    signals = {
        name: {"diff": d.diff, "low": d.low, "high": d.high}
        for name, d in comparison.diffs.items()
        if name in policy.signals
    }
    record_audit(
        session,
        actor=actor,
        action=READY_ACTION,
        target=f"checkpoint:{canary.checkpoint_id}",
        details={
            "reason": (
                f"ran its planned size ({comparison.canary_sessions} canary / {comparison.production_sessions} "
                f"production sessions, at least {policy.min_sessions} each) with no signal regressed at "
                f"{policy.confidence:.0%}: ready for a release manager's promotion"
            ),
            "canary_id": str(canary.id),
            "production_id": canary.production_id,
            "canary_sessions": comparison.canary_sessions,
            "production_sessions": comparison.production_sessions,
            "signals": signals,
        },
    )
    return out

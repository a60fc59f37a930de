"""Online product signals per checkpoint, read from finalized trajectories (the queries behind
``GET /v1/checkpoints/{id}/online``, the dashboard chart and the online promotion policy).

Invariant: only finalized trajectories count (their late signals arrived or the window closed),
each attributed to the checkpoint that served the session's start (``trajectory.checkpoint_id``,
from ``model.responded`` / ``session.started``). A canary is compared with the production it ran
beside, over the canary's own window (sessions started between ``started_at`` and ``stopped_at``),
so both arms saw the same traffic period. The statistics are in ``app.lifecycle.online_stats``.
Reads only; no FastAPI here.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.lifecycle.online_stats import (
    SIGNALS,
    Comparison,
    OnlinePolicy,
    SessionSignals,
    compare_arms,
    policy_reasons,
    ratio_estimate,
    z_for,
)
from app.models import Canary, Checkpoint, GateDecision, RewardLabel, Trajectory

TIMELINE_POINTS = 8


def load_sessions(
    session: Session, checkpoint_id: str, *, since: datetime | None = None, until: datetime | None = None
) -> list[tuple[datetime | None, SessionSignals]]:
    """``(started_at, signals)`` of every finalized session served by ``checkpoint_id`` (started in
    ``[since, until]`` when given), oldest first. The reward is the newest label of the session."""
    latest = (
        select(RewardLabel.trajectory_id, RewardLabel.reward)
        .distinct(RewardLabel.trajectory_id)
        .order_by(RewardLabel.trajectory_id, RewardLabel.created_at.desc())
        .subquery()
    )
    stmt = (
        select(
            Trajectory.started_at, Trajectory.user_id, Trajectory.signals, Trajectory.completion_tokens, latest.c.reward
        )
        .outerjoin(latest, latest.c.trajectory_id == Trajectory.id)
        .where(Trajectory.checkpoint_id == checkpoint_id, Trajectory.status == "finalized")
        .order_by(Trajectory.started_at, Trajectory.id)
    )
    if since is not None:
        stmt = stmt.where(Trajectory.started_at >= since)
    if until is not None:
        stmt = stmt.where(Trajectory.started_at <= until)
    return [
        (r.started_at, SessionSignals.from_projection(r.user_id, r.signals, r.completion_tokens, r.reward))
        for r in session.execute(stmt)
    ]


def signal_summary(sessions: Sequence[SessionSignals], confidence: float = 0.95) -> dict[str, Any]:
    """Per signal: value with its clustered interval, users and sessions that define it."""
    z = z_for(confidence)
    out: dict[str, Any] = {"sessions": len(sessions), "users": len({s.user_id for s in sessions}), "signals": {}}
    for name in SIGNALS:
        est = ratio_estimate(sessions, name)
        out["signals"][name] = (
            None
            if est is None
            else {
                "value": est.value,
                "low": est.value - z * est.se,
                "high": est.value + z * est.se,
                "se": est.se,
                "users": est.users,
                "sessions": est.sessions,
            }
        )
    return out


def comparison_view(comparison: Comparison) -> dict[str, Any]:
    """A JSON-ready view of a comparison (per signal: both arms, difference, interval, regressed)."""
    signals = {}
    for name, d in comparison.diffs.items():
        signals[name] = {
            "unit": SIGNALS[name][0],
            "higher_is_better": d.higher_is_better,
            "canary": d.canary.value if d.canary else None,
            "production": d.production.value if d.production else None,
            "diff": d.diff,
            "low": d.low,
            "high": d.high,
            "regressed": d.regressed,
        }
    return {
        "canary_sessions": comparison.canary_sessions,
        "production_sessions": comparison.production_sessions,
        "signals": signals,
    }


def latest_canary(session: Session, checkpoint_id: str, production_id: str | None = None) -> Canary | None:
    """The newest canary of ``checkpoint_id`` (against ``production_id`` when given)."""
    stmt = select(Canary).where(Canary.checkpoint_id == checkpoint_id)
    if production_id is not None:
        stmt = stmt.where(Canary.production_id == production_id)
    return session.scalars(stmt.order_by(Canary.started_at.desc()).limit(1)).first()


def canary_arms(session: Session, canary: Canary) -> tuple[list[tuple[datetime | None, SessionSignals]], ...]:
    """Sessions of the canary arm and of the production arm over the canary's window."""
    until = canary.stopped_at
    return (
        load_sessions(session, canary.checkpoint_id, since=canary.started_at, until=until),
        load_sessions(session, canary.production_id, since=canary.started_at, until=until),
    )


def compare_canary(session: Session, canary: Canary, policy: OnlinePolicy) -> Comparison:
    """Canary minus production over the canary's window, for the policy's signals."""
    c, p = canary_arms(session, canary)
    return compare_arms([s for _, s in c], [s for _, s in p], policy.signals, policy.confidence)


def online_reasons(session: Session, checkpoint_id: str, production_id: str | None, policy: OnlinePolicy) -> list[str]:
    """Why the online policy refuses to promote ``checkpoint_id`` (empty when it allows it or is
    not required). Fails closed: no canary against this production, or too few sessions."""
    if not policy.required:
        return []
    canary = latest_canary(session, checkpoint_id, production_id)
    if canary is None:
        return [
            f"the online policy requires a canary of {checkpoint_id} against production {production_id}: "
            "none ran (POST /v1/canaries)"
        ]
    return policy_reasons(compare_canary(session, canary, policy), policy)


def _timeline(
    canary_rows: Sequence[tuple[datetime | None, SessionSignals]],
    production_rows: Sequence[tuple[datetime | None, SessionSignals]],
    policy: OnlinePolicy,
    start: datetime,
    end: datetime,
) -> list[dict[str, Any]]:
    """The differences recomputed on the sessions started up to each of ``TIMELINE_POINTS`` instants."""
    points = []
    span = (end - start).total_seconds()
    for k in range(1, TIMELINE_POINTS + 1):
        cut = start if span <= 0 else datetime.fromtimestamp(start.timestamp() + span * k / TIMELINE_POINTS, tz=UTC)
        c = [s for t, s in canary_rows if t is None or t <= cut]
        p = [s for t, s in production_rows if t is None or t <= cut]
        view = comparison_view(compare_arms(c, p, SIGNALS, policy.confidence))
        points.append({"at": cut.isoformat(), **view})
        if span <= 0:
            break
    return points


def online_view(
    session: Session, row: Checkpoint, *, policy: OnlinePolicy | None = None, lineage_rows: Sequence[Checkpoint] = ()
) -> dict[str, Any]:
    """What ``GET /v1/checkpoints/{id}/online`` returns: the checkpoint's signals over all its
    sessions, its newest canary's comparison with production (with the timeline over the canary's
    life and the policy's verdict), and the signals of each checkpoint of its lineage."""
    if policy is None:
        gate = session.scalars(
            select(GateDecision)
            .where(GateDecision.candidate_id == row.id)
            .order_by(GateDecision.created_at.desc())
            .limit(1)
        ).first()
        policy = OnlinePolicy.from_config((gate.report or {}).get("config") if gate else None)
    out: dict[str, Any] = {
        "checkpoint_id": row.id,
        "policy": {
            "required": policy.required,
            "min_sessions": policy.min_sessions,
            "signals": list(policy.signals),
            "confidence": policy.confidence,
        },
        "overall": signal_summary([s for _, s in load_sessions(session, row.id)], policy.confidence),
        "canary": None,
        "lineage": [],
    }
    canary = latest_canary(session, row.id)
    if canary is not None:
        c, p = canary_arms(session, canary)
        comparison = compare_arms([s for _, s in c], [s for _, s in p], SIGNALS, policy.confidence)
        latest = [t for t, _ in c + p if t is not None]
        end = canary.stopped_at or max([datetime.now(UTC), *latest])
        reasons = policy_reasons(
            compare_arms([s for _, s in c], [s for _, s in p], policy.signals, policy.confidence), policy
        )
        out["canary"] = {
            "id": str(canary.id),
            "status": canary.status,
            "fraction": canary.fraction,
            "production_id": canary.production_id,
            "started_at": canary.started_at.isoformat(),
            "stopped_at": canary.stopped_at.isoformat() if canary.stopped_at else None,
            **comparison_view(comparison),
            "policy_passed": not reasons,
            "policy_reasons": reasons,
            "timeline": _timeline(c, p, policy, canary.started_at, end),
        }
    for ancestor in lineage_rows:
        summary = signal_summary([s for _, s in load_sessions(session, ancestor.id)], policy.confidence)
        out["lineage"].append({"checkpoint_id": ancestor.id, "status": ancestor.status, **summary})
    return out

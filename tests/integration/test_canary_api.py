"""Canaries through HTTP on real Postgres: role checks, audit and outbox, one active canary, the
online report, and the online promotion policy (fail closed, then allow, then block a regression)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError

from app.models import AuditLog, Canary, Checkpoint, GateDecision, Outbox, RewardLabel, Trajectory
from tests.integration.test_api_support import auth, base, client, gated, make_token, seed_checkpoint, seed_gate, store  # noqa: F401

pytestmark = pytest.mark.integration


@pytest.fixture
def rm(session):
    return auth(make_token(session, "release_manager", name="alice"))


def _start(client, headers, checkpoint_id="ckpt-0001", fraction=0.2, reason="canary before promotion"):
    return client.post(
        "/v1/canaries", headers=headers, json={"checkpoint_id": checkpoint_id, "fraction": fraction, "reason": reason}
    )


def _stop(client, headers, canary_id=None, reason="enough data"):
    url = "/v1/canaries" + (f"/{canary_id}" if canary_id else "")
    return client.request("DELETE", url, headers=headers, json={"reason": reason})


def test_only_a_release_manager_starts_or_stops_a_canary(client, session, gated, rm):
    viewer = auth(make_token(session, "viewer"))
    service = auth(make_token(session, "service"))
    assert _start(client, {}).status_code == 401
    assert _start(client, viewer).status_code == 403
    assert _start(client, service).json()["error"]["code"] == "forbidden"
    assert session.scalar(select(sa.func.count()).select_from(Canary)) == 0
    started = _start(client, rm)
    assert started.status_code == 201, started.text
    assert _stop(client, viewer).status_code == 403
    assert client.get("/v1/canaries", headers=viewer).json()["active"]["id"] == started.json()["id"]
    assert _start(client, rm, fraction=1.0).status_code == 422  # the whole traffic is a promotion, not a canary
    assert _start(client, rm, fraction=0).status_code == 422


def test_start_and_stop_are_audited_and_announced(client, session, gated, rm):
    body = _start(client, rm).json()
    assert (body["checkpoint_id"], body["production_id"], body["fraction"], body["status"]) == (
        "ckpt-0001",
        "base",
        0.2,
        "active",
    )
    audit = session.scalars(select(AuditLog).where(AuditLog.action == "canary.started")).one()
    assert audit.actor == "alice" and audit.target == "checkpoint:ckpt-0001"
    assert audit.details["canary_id"] == body["id"] and audit.details["reason"] == "canary before promotion"
    msg = session.scalars(select(Outbox).where(Outbox.event_type == "canary.started")).one()
    assert msg.payload["canary_id"] == body["id"] and msg.payload["fraction"] == 0.2
    assert [c["id"] for c in msg.payload["lineage"]] == ["ckpt-0001", "base"]
    stopped = _stop(client, rm)
    assert stopped.status_code == 200 and stopped.json()["status"] == "stopped"
    assert stopped.json()["stopped_by"] == "alice"
    session.expire_all()
    assert [a.action for a in session.scalars(select(AuditLog).order_by(AuditLog.id))][-2:] == [
        "canary.started",
        "canary.stopped",
    ]
    assert (
        session.scalars(select(Outbox).where(Outbox.event_type == "canary.stopped")).one().payload["canary_id"]
        == body["id"]
    )
    assert _stop(client, rm).status_code == 404  # none active
    again = _stop(client, rm, canary_id=body["id"])
    assert again.status_code == 409 and "already stopped" in again.json()["error"]["message"]


def test_one_active_canary_and_only_a_gated_candidate(client, session, store, gated, rm):
    seed_checkpoint(session, store, "ckpt-0002", parent_id="base", generation=1)  # never gated
    refused = _start(client, rm, "ckpt-0002")
    assert refused.status_code == 409
    reasons = refused.json()["error"]["reasons"]
    assert any("no gate decision" in r for r in reasons) and any("not 'gate_passed'" in r for r in reasons)
    assert _start(client, rm, "base").status_code == 409  # production is not its own canary
    assert _start(client, rm, "ckpt-9999").status_code == 404
    first = _start(client, rm).json()
    seed_gate(session, "ckpt-0002", "base", passed=True)
    second = _start(client, rm, "ckpt-0002")
    assert second.status_code == 409
    assert second.json()["error"]["reasons"] == [f"canary {first['id']} of ckpt-0001 is active: stop it first"]
    # the partial unique index refuses a second active row even from a writer that skips the service
    session.add(
        Canary(
            id=uuid.uuid4(),
            checkpoint_id="ckpt-0002",
            production_id="base",
            fraction=0.1,
            status="active",
            actor="rogue",
            reason="",
        )
    )
    with pytest.raises(IntegrityError):
        session.commit()
    session.rollback()


def _sessions(
    session,
    checkpoint_id: str,
    users: int,
    per_user: int,
    *,
    accept: float,
    reward: float,
    latency_s: float,
    start: datetime,
) -> None:
    """Finalized trajectories served by ``checkpoint_id``: about ``accept`` of each user's sessions
    accepted their one edit (the rest rejected it); users differ by one session either way."""
    for u in range(users):
        n_accepted = round(per_user * accept) + (u % 3 - 1)
        for k in range(per_user):
            tid = uuid.uuid4()
            accepted = k < n_accepted
            session.add(
                Trajectory(
                    id=tid,
                    session_id=f"s-{tid}",
                    user_id=f"{checkpoint_id}-u{u}",
                    org_id="o",
                    checkpoint_id=checkpoint_id,
                    status="finalized",
                    started_at=start + timedelta(seconds=u * per_user + k),
                    completion_tokens=100,
                    signals={
                        "edits": {
                            "e1": {
                                "decision": "accepted" if accepted else "rejected",
                                "persisted": 0.9 if accepted else None,
                            }
                        },
                        "followups": 0 if accepted else 1,
                        "dissatisfied_followups": 0 if accepted else 1,
                        "latency_s": latency_s + 0.1 * (k % 3),
                    },
                )
            )
            session.flush()
            session.add(RewardLabel(trajectory_id=tid, spec="implicit@1", reward=reward if accepted else -reward))
    session.commit()


def _require_online(session, min_sessions: int) -> None:
    gate = session.scalars(select(GateDecision).where(GateDecision.candidate_id == "ckpt-0001")).one()
    gate.report = {
        "config": {
            "online": {
                "required": True,
                "min_sessions": min_sessions,
                "signals": ["edit_acceptance", "dissatisfied_followup_rate", "latency_per_token", "mean_reward"],
            }
        }
    }
    session.commit()


def _promote(client, headers):
    return client.post(
        "/v1/promotions",
        headers=headers,
        json={"checkpoint_id": "ckpt-0001", "reason": "canary ok", "expected_production_id": "base"},
    )


def test_online_policy_fails_closed_then_allows_an_equal_canary_and_ends_it(client, session, gated, rm):
    _require_online(session, min_sessions=40)
    no_canary = _promote(client, rm)
    assert no_canary.status_code == 409
    assert any("requires a canary of ckpt-0001" in r for r in no_canary.json()["error"]["reasons"])
    canary_id = _start(client, rm).json()["id"]
    start = datetime.now(UTC) + timedelta(seconds=1)
    _sessions(session, "ckpt-0001", users=4, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    _sessions(session, "base", users=8, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    few = _promote(client, rm)
    assert few.status_code == 409
    assert "too few canary sessions for the online policy: 20 < 40" in few.json()["error"]["reasons"]
    _sessions(session, "ckpt-0001", users=4, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    report = client.get("/v1/checkpoints/ckpt-0001/online", headers=rm).json()
    assert report["canary"]["canary_sessions"] == 40 and report["canary"]["production_sessions"] == 40
    assert report["canary"]["policy_passed"] and report["canary"]["policy_reasons"] == []
    acc = report["canary"]["signals"]["edit_acceptance"]
    assert acc["canary"] == pytest.approx(22 / 40) and acc["production"] == pytest.approx(23 / 40)
    assert acc["low"] < acc["diff"] < acc["high"] and acc["low"] < 0 < acc["high"]
    assert report["overall"]["signals"]["edit_acceptance"]["value"] == pytest.approx(22 / 40)
    assert [p["checkpoint_id"] for p in report["lineage"]] == ["ckpt-0001", "base"]
    assert report["canary"]["timeline"][-1]["canary_sessions"] == 40
    promoted = _promote(client, rm)
    assert promoted.status_code == 201, promoted.text
    session.expire_all()
    ended = session.get(Canary, uuid.UUID(canary_id))
    assert ended.status == "stopped" and "the canary was promoted" in ended.stop_reason
    assert client.get("/v1/canaries", headers=rm).json()["active"] is None


def test_online_policy_blocks_a_canary_whose_signals_regressed(client, session, gated, rm):
    _require_online(session, min_sessions=40)
    _start(client, rm)
    start = datetime.now(UTC) + timedelta(seconds=1)
    _sessions(session, "ckpt-0001", users=10, per_user=5, accept=0.2, reward=1.0, latency_s=9.0, start=start)
    _sessions(session, "base", users=10, per_user=5, accept=0.8, reward=1.0, latency_s=5.0, start=start)
    refused = _promote(client, rm)
    assert refused.status_code == 409
    reasons = refused.json()["error"]["reasons"]
    for signal in ("edit_acceptance", "dissatisfied_followup_rate", "latency_per_token", "mean_reward"):
        assert any(r.startswith(f"online signal {signal} regressed") for r in reasons), (signal, reasons)
    assert session.scalar(select(Checkpoint.status).where(Checkpoint.id == "base")) == "production"
    report = client.get("/v1/checkpoints/ckpt-0001/online", headers=rm).json()
    assert not report["canary"]["policy_passed"] and report["canary"]["signals"]["edit_acceptance"]["regressed"]


def test_cli_starts_reports_and_stops_a_canary(session, gated):
    from typer.testing import CliRunner

    from ops.cli import app

    runner = CliRunner()
    out = runner.invoke(app, ["canary", "start", "ckpt-0001", "--fraction", "0.25", "--reason", "cli canary"])
    assert out.exit_code == 0, out.output
    assert "ckpt-0001 serves 25.0% of users beside base" in out.output
    status = runner.invoke(app, ["canary", "status"])
    assert status.exit_code == 0 and "ckpt-0001 on 25.0% of users vs base; sessions 0 vs 0" in status.output
    assert "edit_acceptance" in status.output
    again = runner.invoke(app, ["canary", "start", "ckpt-0001", "--fraction", "0.25", "--reason", "twice"])
    assert again.exit_code != 0  # the ConflictError propagates (flywheel's main prints its reasons)
    stopped = runner.invoke(app, ["canary", "stop", "--reason", "cli done"])
    assert stopped.exit_code == 0 and "stopped" in stopped.output
    session.expire_all()
    actions = [a.action for a in session.scalars(select(AuditLog).order_by(AuditLog.id))]
    assert actions[-2:] == ["canary.started", "canary.stopped"]
    assert session.scalars(select(AuditLog).where(AuditLog.action == "canary.started")).one().actor.startswith("cli:")

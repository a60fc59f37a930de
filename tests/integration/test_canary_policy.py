"""The canary policy acts, on real Postgres: a canary whose signals regressed significantly is
ended (audited, announced), one that ran its planned size without a regression is marked ready
once, and repeated runs (beat task, CLI) change nothing more. The serving front takes the active
canary from the database at start and follows the broker, so an ended canary's users return to
production."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import httpx
import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.core.settings import get_settings
from app.lifecycle.assignment import assign_arm
from app.lifecycle.canary import start_canary
from app.models import AuditLog, Canary, Checkpoint, Outbox
from app.outbox.relay import OutboxRelay
from app.promotion.canary_policy import POLICY_ACTOR, evaluate_canary
from app.promotion.tasks import evaluate_canary_task
from app.worker.schedule import beat_schedule
from ops.cli import app
from serving.front_lifecycle import LifecycleFollower
from serving.front_routing import Canary as FrontCanary
from serving.front_routing import FrontRouter
from tests.integration.test_api_support import (  # noqa: F401
    auth,
    base,
    client,
    gated,
    lifecycle_topic,
    make_token,
    store,
)
from tests.integration.test_canary_api import _require_online, _sessions

pytestmark = pytest.mark.integration


@pytest.fixture
def canary(session, gated) -> Canary:
    row = start_canary(session, checkpoint_id=gated.id, fraction=0.3, actor="alice", reason="try it")
    session.commit()
    return row


def _actions(session, action: str) -> list[AuditLog]:
    return list(session.scalars(select(AuditLog).where(AuditLog.action == action).order_by(AuditLog.id)))


def test_a_regressed_canary_is_ended_and_its_users_return_to_production(session, canary):
    _require_online(session, min_sessions=40)  # the regression acts before the planned size is reached
    start = datetime.now(UTC) - timedelta(minutes=5)
    session.execute(Canary.__table__.update().values(started_at=start - timedelta(seconds=1)))
    _sessions(session, "ckpt-0001", users=6, per_user=5, accept=0.2, reward=1.0, latency_s=9.0, start=start)
    _sessions(session, "base", users=6, per_user=5, accept=0.8, reward=1.0, latency_s=5.0, start=start)
    result = evaluate_canary(session)
    session.commit()
    assert result.outcome == "ended" and result.canary_id == str(canary.id)
    assert any(r.startswith("online signal edit_acceptance regressed") for r in result.reasons)
    session.expire_all()
    row = session.get(Canary, canary.id)
    assert row.status == "stopped" and row.stopped_by == POLICY_ACTOR
    assert row.stop_reason.startswith("the canary policy ended it: online signal")
    (stopped,) = _actions(session, "canary.stopped")
    assert stopped.actor == POLICY_ACTOR and stopped.details["canary_id"] == str(canary.id)
    message = session.scalars(select(Outbox).where(Outbox.event_type == "canary.stopped")).one()
    assert message.payload["canary_id"] == str(canary.id)  # the serving watcher stops routing on it
    assert session.get(Checkpoint, "base").status == "production"
    assert evaluate_canary(session).outcome == "no_canary"  # idempotent: nothing more happens
    session.commit()
    assert len(_actions(session, "canary.stopped")) == 1


def test_a_canary_that_ran_its_planned_size_is_marked_ready_once(client, session, canary):
    _require_online(session, min_sessions=40)
    start = datetime.now(UTC) - timedelta(minutes=5)
    session.execute(Canary.__table__.update().values(started_at=start - timedelta(seconds=1)))
    _sessions(session, "ckpt-0001", users=4, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    _sessions(session, "base", users=8, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    waiting = evaluate_canary(session)
    session.commit()
    assert waiting.outcome == "waiting"
    assert "too few canary sessions for the online policy: 20 < 40" in waiting.reasons
    _sessions(session, "ckpt-0001", users=4, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    ready = evaluate_canary(session)
    session.commit()
    assert (ready.outcome, ready.reasons, ready.canary_sessions, ready.production_sessions) == ("ready", [], 40, 40)
    (entry,) = _actions(session, "canary.ready")
    assert entry.actor == POLICY_ACTOR and entry.details["canary_id"] == str(canary.id)
    assert "ready for a release manager's promotion" in entry.details["reason"]
    assert set(entry.details["signals"]) == {
        "edit_acceptance",
        "dissatisfied_followup_rate",
        "latency_per_token",
        "mean_reward",
    }
    assert evaluate_canary(session).outcome == "already_ready"
    session.commit()
    assert len(_actions(session, "canary.ready")) == 1
    viewer = auth(make_token(session, "viewer"))
    active = client.get("/v1/canaries", headers=viewer).json()["active"]
    assert active["status"] == "active" and active["ready_at"] is not None  # still serving, for the RM to promote


def test_cli_and_beat_task_run_the_policy(session, canary, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_CANARY_EVAL_INTERVAL", "15")
    get_settings.cache_clear()
    by_task = {e["task"]: e for e in beat_schedule().values()}
    assert by_task["flywheel.promotion.evaluate_canary"]["schedule"] == 15.0
    out = CliRunner().invoke(app, ["canary", "evaluate"])
    assert out.exit_code == 0, out.output
    result = json.loads(out.output)
    assert result["outcome"] == "waiting" and result["canary_id"] == str(canary.id)
    assert any("too few canary sessions" in r for r in result["reasons"])
    assert evaluate_canary_task.run()["outcome"] == "waiting"
    session.expire_all()
    assert session.get(Canary, uuid.UUID(result["canary_id"])).status == "active"


def test_the_front_routes_by_the_registry_at_start_and_follows_the_policy_ending_a_canary(
    session, store, lifecycle_topic, canary, kafka_bootstrap, tmp_path, monkeypatch
):  # the lifecycle topic first: the canary's outbox row is written to it
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    router = FrontRouter("http://127.0.0.1:9", lambda: None, httpx.AsyncClient())
    front = LifecycleFollower(router, bootstrap=kafka_bootstrap, topic=lifecycle_topic)
    users = [f"user-{i:03d}" for i in range(60)]
    canary_users = {u for u in users if assign_arm(u, str(canary.id), canary.fraction) == "canary"}
    assert canary_users and len(canary_users) < len(users)
    try:
        # a (re)started front takes the active canary from the database before any message
        assert front.begin() == FrontCanary(str(canary.id), "ckpt-0001", 0.3)
        assert {u for u in users if router.arm_of(u) == "canary"} == canary_users
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1  # canary.started, after the front's start position
        for _ in range(8):
            front.poll_once(timeout_ms=250)
        assert router.canary == FrontCanary(str(canary.id), "ckpt-0001", 0.3)
        start = datetime.now(UTC) - timedelta(minutes=5)
        session.execute(Canary.__table__.update().values(started_at=start - timedelta(seconds=1)))
        _sessions(session, "ckpt-0001", users=6, per_user=5, accept=0.2, reward=1.0, latency_s=9.0, start=start)
        _sessions(session, "base", users=6, per_user=5, accept=0.8, reward=1.0, latency_s=5.0, start=start)
        assert evaluate_canary(session).outcome == "ended"
        session.commit()
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1  # canary.stopped
        for _ in range(40):
            front.poll_once(timeout_ms=250)
            if router.canary is None:
                break
        assert router.canary is None and {router.arm_of(u) for u in users} == {"production"}
    finally:
        front.stop()


def test_auto_on_pass_starts_the_required_canary_and_promotes_it_once_ready(session, gated, monkeypatch):
    """No one at the keyboard: the gate passed but the online policy requires a canary, so the
    release policy starts one (audited as the policy) instead of holding forever; beat's canary pass
    marks it ready on its sessions, and the release policy then promotes it on that evidence."""
    from app.lifecycle.release import ReleasePolicy, ReleaseSettings, apply_release_policy

    monkeypatch.setenv("FLYWHEEL_RELEASE_POLICY", "auto_on_pass")
    _require_online(session, min_sessions=40)
    settings = ReleaseSettings(policy=ReleasePolicy.AUTO_ON_PASS, canary_fraction=0.25)
    started = apply_release_policy(session, gated.id, settings)
    session.commit()
    assert started.outcome == "canary_started"
    canary = session.scalars(select(Canary).where(Canary.status == "active")).one()
    assert (canary.checkpoint_id, canary.fraction, canary.actor) == (gated.id, 0.25, "release-policy")
    again = apply_release_policy(session, gated.id, settings)  # a redelivered gate task: no second canary
    session.commit()
    assert again.outcome == "held" and any("too few canary sessions" in r for r in again.reasons)
    assert len(session.scalars(select(Canary)).all()) == 1

    start = datetime.now(UTC) - timedelta(minutes=5)
    session.execute(Canary.__table__.update().values(started_at=start - timedelta(seconds=1)))
    _sessions(session, gated.id, users=8, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    _sessions(session, "base", users=8, per_user=5, accept=0.6, reward=1.0, latency_s=5.0, start=start)
    session.commit()
    result = evaluate_canary_task.run()
    assert result["outcome"] == "ready" and result["release"]["outcome"] == "promoted"
    session.expire_all()
    assert session.get(Checkpoint, gated.id).status == "production"
    assert session.get(Canary, canary.id).status == "stopped"  # the promotion ends the canary
    (promoted,) = _actions(session, "checkpoint.promoted")
    assert promoted.actor == "release-policy"
    assert evaluate_canary_task.run()["outcome"] == "no_canary"

"""An erasure reaches the whole lineage on real Postgres: descendants of a checkpoint trained on the
erased data are flagged with a visible reason, a flagged canary stops, a flagged production is
rolled back (audited, announced) to its newest clean ancestor, and with none it says so loudly."""

from __future__ import annotations

import logging
import os
import uuid
from datetime import UTC, datetime

import pytest
from sqlalchemy import select, text

from app.checkpoints.store import STABLE
from app.lifecycle.canary import start_canary
from app.models import AuditLog, Canary, Checkpoint, CheckpointTrajectory, Outbox, Promotion, TrainingCycle
from app.promotion.service import promote_checkpoint
from consumers.erasure import erase_now
from tests.integration.test_api_support import auth, base, client, make_token, seed_checkpoint, seed_gate, store  # noqa: F401

pytestmark = pytest.mark.integration


def _promote(session, checkpoint_id: str, production_id: str) -> None:
    seed_gate(session, checkpoint_id, production_id, passed=True)
    promote_checkpoint(
        session, checkpoint_id=checkpoint_id, expected_production_id=production_id, actor="alice", reason="gated"
    )
    session.commit()


def _trained_on(session, checkpoint_id: str, user_id: str) -> None:
    session.add(CheckpointTrajectory(checkpoint_id=checkpoint_id, trajectory_id=uuid.uuid4(), user_id=user_id))
    session.commit()


@pytest.fixture
def chain(session, store, base):
    """base -> ckpt-0001 -> ckpt-0002 (production, both promoted in turn) -> ckpt-0003 (canaried)."""
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    _promote(session, "ckpt-0001", "base")
    seed_checkpoint(session, store, "ckpt-0002", parent_id="ckpt-0001", generation=2)
    _promote(session, "ckpt-0002", "ckpt-0001")
    seed_checkpoint(session, store, "ckpt-0003", parent_id="ckpt-0002", generation=3)
    seed_gate(session, "ckpt-0003", "ckpt-0002", passed=True)
    start_canary(session, checkpoint_id="ckpt-0003", fraction=0.2, actor="alice", reason="try it")
    session.commit()


def test_erasure_flags_descendants_and_rolls_production_back_to_a_clean_ancestor(client, session, chain):
    _trained_on(session, "ckpt-0001", "u-alice")  # only ckpt-0001 trained on her data directly
    out = erase_now(session, "u-alice", "req-1")
    session.commit()
    assert out.checkpoints_flagged == ["ckpt-0001", "ckpt-0002", "ckpt-0003"]
    assert out.rolled_back_to == "base" and out.production_unresolved == []
    session.expire_all()
    flags = {c.id: (c.trained_on_erased, c.status) for c in session.scalars(select(Checkpoint))}
    assert flags == {
        "base": (False, "production"),
        "ckpt-0001": (True, "retired"),
        "ckpt-0002": (True, "retired"),
        "ckpt-0003": (True, "gate_passed"),
    }
    # the normal rollback path: a promotion row of kind rollback, its audit entry and outbox message
    rollback = session.scalars(select(Promotion).where(Promotion.kind == "rollback")).one()
    assert (rollback.checkpoint_id, rollback.previous_production_id, rollback.actor) == (
        "base",
        "ckpt-0002",
        "consumers:erasure",
    )
    audit = session.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.rolled_back")).one()
    assert "production ckpt-0002 is flagged: descends from ckpt-0001" in audit.details["reason"]
    assert "erasure request req-1" in audit.details["reason"]
    assert "ckpt-0001: flagged too" in audit.details["reason"]  # the flagged parent was passed over
    message = session.scalars(select(Outbox).where(Outbox.event_type == "checkpoint.rolled_back")).one()
    assert message.payload["checkpoint_id"] == "base"
    # the canary of a flagged checkpoint stopped: its users are back on production
    canary = session.scalars(select(Canary)).one()
    assert canary.status == "stopped" and canary.stopped_by == "consumers:erasure"
    assert "ckpt-0003 is flagged" in canary.stop_reason
    # the release manager sees the flag and why, on every flagged checkpoint
    flagged = {
        a.target: a.details["reason"]
        for a in session.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.erasure_flagged"))
    }
    assert flagged["checkpoint:ckpt-0001"].startswith("trained on data of an erased user (erasure request req-1)")
    assert flagged["checkpoint:ckpt-0003"].startswith("descends from ckpt-0001")
    viewer = auth(make_token(session, "viewer"))
    detail = client.get("/v1/checkpoints/ckpt-0002", headers=viewer).json()
    assert detail["trained_on_erased"] and detail["erasure_reason"].startswith("descends from ckpt-0001")
    listed = {c["id"]: c["erasure_reason"] for c in client.get("/v1/checkpoints", headers=viewer).json()["items"]}
    assert listed["base"] is None and listed["ckpt-0003"].startswith("descends from ckpt-0001")
    assert client.get("/v1/production", headers=viewer).json()["checkpoint"]["id"] == "base"
    # the request names every affected checkpoint; a redelivery changes nothing
    assert erase_now(session, "u-alice", "req-1").repeated
    session.commit()
    assert session.scalar(select(Promotion.kind).order_by(Promotion.created_at.desc()).limit(1)) == "rollback"


def test_a_flagged_production_without_a_clean_ancestor_is_reported_loudly(session, store, chain, caplog):
    os.remove(os.path.join(session.get(Checkpoint, "base").path, STABLE))  # base can no longer be served
    _trained_on(session, "ckpt-0001", "u-bob")
    with caplog.at_level(logging.ERROR, logger="app.lifecycle.erasure"):
        out = erase_now(session, "u-bob", "req-2")
        session.commit()
    assert out.rolled_back_to is None
    assert out.production_unresolved == ["ckpt-0001: flagged too", f"base: not STABLE at {store.path('base')}"]
    assert session.scalar(select(Checkpoint.id).where(Checkpoint.status == "production")) == "ckpt-0002"
    assert any("ckpt-0002 is flagged" in r.message and "KEEPS SERVING" in r.message for r in caplog.records)
    entry = session.scalars(select(AuditLog).where(AuditLog.action == "production.erasure_unresolved")).one()
    assert entry.target == "checkpoint:ckpt-0002" and entry.details["refused"] == out.production_unresolved


def test_a_candidate_of_a_flagged_parent_is_registered_flagged(session, store, chain):
    from trainer.data import CycleData
    from trainer.records import register_candidate

    _trained_on(session, "ckpt-0002", "u-carol")
    erase_now(session, "u-carol", "req-3")
    session.commit()
    cycle = TrainingCycle(id=uuid.uuid4(), status="running", parent_checkpoint_id="ckpt-0003")
    session.add(cycle)
    session.flush()
    parent = session.get(Checkpoint, "ckpt-0003")
    data = CycleData(
        reward_spec="implicit@1",
        parent_id=parent.id,
        parent_generation=3,
        window_start=None,
        window_end=datetime.now(UTC),
    )
    row = register_candidate(
        session,
        cycle_id=cycle.id,
        checkpoint_id="ckpt-0004",
        path=str(store.path("ckpt-0004")),
        parent=parent,
        data=data,
        manifest={},
        metrics={},
    )
    session.commit()
    assert row.trained_on_erased
    reason = session.scalars(
        select(AuditLog.details).where(AuditLog.target == "checkpoint:ckpt-0004", AuditLog.action.like("%flagged"))
    ).one()["reason"]
    assert reason.startswith("descends from ckpt-0003, which is flagged: descends from ckpt-0002")
    requested = session.execute(text("SELECT checkpoints_flagged FROM erasure_request")).scalar_one()
    assert requested == ["ckpt-0002", "ckpt-0003", "ckpt-0004"]

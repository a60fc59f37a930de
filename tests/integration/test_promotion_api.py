"""Promotion, rollback, rejection and the read endpoints through HTTP on real Postgres."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
import sqlalchemy as sa
from sqlalchemy import select

from app.models import AuditLog, Checkpoint, Outbox, Promotion
from tests.integration.test_api_support import (  # noqa: F401
    PNG_1PX,
    auth,
    base,
    client,
    gated,
    make_token,
    seed_checkpoint,
    seed_eval_run,
    seed_gate,
    store,
)

pytestmark = pytest.mark.integration


@pytest.fixture
def rm(session):
    return auth(make_token(session, "release_manager", name="alice"))


def _promote(client, headers, checkpoint_id, expected="base", reason="better on humaneval"):
    return client.post(
        "/v1/promotions",
        headers=headers,
        json={"checkpoint_id": checkpoint_id, "reason": reason, "expected_production_id": expected},
    )


def _statuses(session) -> dict[str, str]:
    session.expire_all()
    return {c.id: c.status for c in session.scalars(select(Checkpoint))}


def _nothing_written(session) -> None:
    assert session.scalar(select(sa.func.count()).select_from(Promotion)) == 0
    assert session.scalar(select(sa.func.count()).select_from(Outbox)) == 0
    assert [a.action for a in session.scalars(select(AuditLog))] == ["token.created"]


def test_promotion_refused_without_gate(client, session, store, base, rm):
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    resp = _promote(client, rm, "ckpt-0001")
    assert resp.status_code == 409
    err = resp.json()["error"]
    assert err["code"] == "conflict"
    assert any("no gate decision" in r for r in err["reasons"])
    assert any("not 'gate_passed'" in r for r in err["reasons"])
    assert _statuses(session) == {"base": "production", "ckpt-0001": "candidate"}
    _nothing_written(session)


def test_promotion_refused_for_failed_gate(client, session, store, base, rm):
    seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, "ckpt-0001", "base", passed=False, reasons=["humaneval regressed"])
    resp = _promote(client, rm, "ckpt-0001")
    assert resp.status_code == 409
    assert any("failed: humaneval regressed" in r for r in resp.json()["error"]["reasons"])
    # A passed gate that is older than a failed one does not count: the latest decides.
    seed_gate(session, "ckpt-0001", "base", passed=True)
    seed_gate(session, "ckpt-0001", "base", passed=False, status="gate_passed")
    assert _promote(client, rm, "ckpt-0001").status_code == 409
    assert _statuses(session)["base"] == "production"
    _nothing_written(session)


def test_promotion_refused_when_not_stable_or_stale(client, session, store, gated, rm):
    resp = _promote(client, rm, gated.id, expected="ckpt-0042")
    assert resp.status_code == 409
    assert resp.json()["error"]["reasons"] == ["expected production 'ckpt-0042' but production is 'base'"]
    (store.path(gated.id) / "STABLE").unlink()
    resp = _promote(client, rm, gated.id)
    assert resp.status_code == 409 and any("not STABLE" in r for r in resp.json()["error"]["reasons"])
    assert _promote(client, rm, "ckpt-9999").status_code == 404
    _nothing_written(session)


def test_promotion_writes_everything_in_one_transaction(client, session, gated, rm):
    resp = _promote(client, rm, gated.id)
    assert resp.status_code == 201, resp.text
    body = resp.json()
    assert body["kind"] == "promotion" and body["checkpoint_id"] == gated.id
    assert body["previous_production_id"] == "base" and body["actor"] == "alice"
    statuses = _statuses(session)
    assert statuses == {"base": "retired", gated.id: "production"}
    assert session.get(Checkpoint, gated.id).promoted_at is not None
    promo = session.scalars(select(Promotion)).one()
    assert promo.gate_decision_id is not None and promo.reason == "better on humaneval"
    audit = session.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.promoted")).one()
    assert audit.actor == "alice" and audit.target == f"checkpoint:{gated.id}"
    assert audit.details["previous_production_id"] == "base"
    msg = session.scalars(select(Outbox)).one()
    assert msg.event_type == "checkpoint.promoted" and msg.key == gated.id and msg.sent_at is None
    assert msg.topic == "flywheel.lifecycle"
    assert msg.payload["previous_production_id"] == "base" and msg.payload["event_id"]
    assert [c["id"] for c in msg.payload["lineage"]] == [gated.id, "base"]
    prod = client.get("/v1/production", headers=rm).json()
    assert prod["checkpoint"]["id"] == gated.id and prod["last_change"]["id"] == body["id"]
    # Promoting again is a conflict, not a second change.
    again = _promote(client, rm, gated.id, expected=gated.id)
    assert again.status_code == 409 and "already production" in again.json()["error"]["message"]


def test_gate_against_an_older_production_is_stale(client, session, store, gated, rm):
    second = seed_checkpoint(session, store, "ckpt-0002", parent_id="base", generation=1)
    seed_gate(session, second.id, "base", passed=True)
    assert _promote(client, rm, gated.id).status_code == 201
    resp = _promote(client, rm, second.id, expected=gated.id)
    assert resp.status_code == 409
    assert any("re-run the gate" in r for r in resp.json()["error"]["reasons"])


def test_rollback_to_previous_and_named_production(client, session, store, gated, rm):
    nope = client.post("/v1/rollbacks", headers=rm, json={"reason": "r", "expected_production_id": "base"})
    assert nope.status_code == 409 and "no earlier production" in nope.json()["error"]["message"]
    assert _promote(client, rm, gated.id).status_code == 201

    stale = client.post("/v1/rollbacks", headers=rm, json={"reason": "r", "expected_production_id": "base"})
    assert stale.status_code == 409
    resp = client.post(
        "/v1/rollbacks", headers=rm, json={"reason": "latency regression in prod", "expected_production_id": gated.id}
    )
    assert resp.status_code == 201, resp.text
    assert resp.json()["kind"] == "rollback" and resp.json()["checkpoint_id"] == "base"
    assert _statuses(session) == {"base": "production", gated.id: "retired"}
    assert [o.event_type for o in session.scalars(select(Outbox).order_by(Outbox.id))] == [
        "checkpoint.promoted",
        "checkpoint.rolled_back",
    ]
    rolled = session.scalars(select(Outbox).order_by(Outbox.id.desc()).limit(1)).one()
    assert rolled.payload["previous_production_id"] == gated.id

    never = seed_checkpoint(session, store, "ckpt-0003", parent_id="base", generation=1)
    seed_gate(session, never.id, "base", passed=True)
    resp = client.post(
        "/v1/rollbacks", headers=rm, json={"reason": "r", "expected_production_id": "base", "checkpoint_id": never.id}
    )
    assert resp.status_code == 409 and any("never been production" in r for r in resp.json()["error"]["reasons"])
    # Rolling "back" to a checkpoint that was production before, by name.
    resp = client.post(
        "/v1/rollbacks",
        headers=rm,
        json={"reason": "it was fine", "expected_production_id": "base", "checkpoint_id": gated.id},
    )
    assert resp.status_code == 201
    assert _statuses(session)[gated.id] == "production"
    assert [a.action for a in session.scalars(select(AuditLog).order_by(AuditLog.id))][-3:] == [
        "checkpoint.promoted",
        "checkpoint.rolled_back",
        "checkpoint.rolled_back",
    ]


def test_reject(client, session, store, gated, rm):
    service = auth(make_token(session, "service", name="erasure-job"))
    resp = client.post(f"/v1/checkpoints/{gated.id}/reject", headers=service, json={"reason": "trained on erased data"})
    assert resp.status_code == 200 and resp.json()["status"] == "rejected"
    assert _promote(client, rm, gated.id).status_code == 409
    again = client.post(f"/v1/checkpoints/{gated.id}/reject", headers=rm, json={"reason": "x"})
    assert again.status_code == 409
    prod = client.post("/v1/checkpoints/base/reject", headers=rm, json={"reason": "x"})
    assert prod.status_code == 409
    msg = session.scalars(select(Outbox)).one()
    assert msg.event_type == "checkpoint.rejected" and msg.payload["actor"] == "erasure-job"
    assert msg.payload["reason"] == "trained on erased data"


def test_audit_log_is_append_only(client, session, gated, rm):
    assert _promote(client, rm, gated.id).status_code == 201
    page = client.get("/v1/audit", headers=rm).json()
    assert [e["action"] for e in page["items"]] == ["checkpoint.promoted", "token.created"]
    engine = session.get_bind()
    for stmt in ("UPDATE audit_log SET actor = 'mallory'", "DELETE FROM audit_log", "TRUNCATE audit_log"):
        with pytest.raises(sa.exc.DBAPIError, match="append-only"):
            with engine.begin() as conn:
                conn.execute(sa.text(stmt))
    assert len(client.get("/v1/audit", headers=rm).json()["items"]) == 2
    only = client.get("/v1/audit", headers=rm, params={"action": "checkpoint.promoted", "limit": 1}).json()
    assert [e["actor"] for e in only["items"]] == ["alice"] and only["next_cursor"] is None


def test_checkpoint_list_is_paginated_newest_first(client, session, store, base, rm):
    now = datetime.now(UTC)
    for i in range(7):
        seed_checkpoint(
            session,
            store,
            f"ckpt-{i:04d}",
            parent_id="base",
            generation=1,
            created_at=now - timedelta(minutes=10 - i),
            stable_dir=False,
        )
    seen, cursor = [], None
    while True:
        page = client.get("/v1/checkpoints", headers=rm, params={"limit": 3, **({"cursor": cursor} if cursor else {})})
        assert page.status_code == 200
        seen += [c["id"] for c in page.json()["items"]]
        cursor = page.json()["next_cursor"]
        if cursor is None:
            break
    assert seen == [f"ckpt-{i:04d}" for i in reversed(range(7))] + ["base"]
    prod = client.get("/v1/checkpoints", headers=rm, params={"status": "production"}).json()
    assert [c["id"] for c in prod["items"]] == ["base"]
    bad = client.get("/v1/checkpoints", headers=rm, params={"cursor": "garbage!"})
    assert bad.status_code == 422 and bad.json()["error"]["code"] == "invalid_request"
    assert client.get("/v1/checkpoints", headers=rm, params={"status": "bogus"}).status_code == 422


def test_checkpoint_detail_lineage(client, session, store, gated, rm):
    child = seed_checkpoint(session, store, "ckpt-0002", parent_id=gated.id, generation=2)
    detail = client.get(f"/v1/checkpoints/{child.id}", headers=rm).json()
    assert detail["lineage"]["parent_chain"] == [gated.id, "base"]
    assert detail["lineage"]["trajectory_count"] == 12 and detail["lineage"]["reward_spec"] == "implicit@1"
    assert detail["lineage"]["data_window"]["start"].startswith("2026-11-20")
    assert detail["metrics"] == {"loss": 0.42, "kl": 0.01} and detail["manifest"]["parent_id"] == gated.id
    assert detail["latest_gate"] is None
    assert client.get(f"/v1/checkpoints/{gated.id}", headers=rm).json()["latest_gate"]["passed"] is True
    assert client.get("/v1/checkpoints/nope", headers=rm).status_code == 404


def test_eval_report_with_intervals_task_diffs_and_png(client, session, store, base, rm, tmp_path):
    cand = seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_eval_run(session, "base", "humaneval", {"t1": [True, True], "t2": [False, False], "t3": [True, True]})
    seed_eval_run(session, cand.id, "humaneval", {"t1": [True, True], "t2": [True, True], "t3": [False, True]})
    png = tmp_path / "reports" / "ckpt-0001.png"
    png.write_bytes(PNG_1PX)
    gate = seed_gate(session, cand.id, "base", passed=True, report_path=str(png))
    report = client.get(f"/v1/checkpoints/{cand.id}/evals", headers=rm).json()
    assert report["gate"]["id"] == str(gate.id) and report["production_id"] == "base"
    assert report["gate_report"] == {"policy": "no-regression@1"}
    (suite,) = report["suites"]
    assert suite["candidate"]["passed"] == 5 and suite["candidate"]["n"] == 6
    assert suite["production"]["passed"] == 4 and suite["diff"] == pytest.approx(1 / 6)
    assert suite["candidate"]["ci_low"] < 5 / 6 < suite["candidate"]["ci_high"]
    assert suite["diff_ci_low"] < 1 / 6 < suite["diff_ci_high"]
    assert [(d["task_id"], d["change"]) for d in report["task_diffs"]] == [("t3", "regressed"), ("t2", "improved")]
    url = report["gate"]["report_url"]
    assert url == f"/v1/reports/{gate.id}/report.png"
    img = client.get(url, headers=rm)
    assert img.status_code == 200 and img.headers["content-type"] == "image/png" and img.content == PNG_1PX
    assert client.get(url).status_code == 401
    # A report path outside the report and checkpoint directories is never served.
    gate.report_path = "/etc/passwd"
    session.commit()
    assert client.get(url, headers=rm).status_code == 404


INSUFFICIENT = {
    "decision": "insufficient_evidence",
    "suites": {
        "functions": {"gated": True, "decision": "insufficient_evidence", "power": 0.0, "margin": 0.045},
        "humaneval": {"gated": True, "decision": "pass", "power": 0.93, "margin": 0.045},
    },
}
POWER_REASON = {
    "check": "power",
    "suite": "functions",
    "gated": True,
    "passed": False,
    "inconclusive": True,
    "message": "functions: power 0.00 to tell an equal candidate from one 4.5% worse at 4 pairs",
}


def _override(client, headers, checkpoint_id, override_reason, expected="base"):
    return client.post(
        "/v1/promotions",
        headers=headers,
        json={
            "checkpoint_id": checkpoint_id,
            "reason": "ship the fix",
            "expected_production_id": expected,
            "override_reason": override_reason,
        },
    )


def test_insufficient_evidence_needs_a_release_managers_written_override(client, session, store, base, rm, monkeypatch):
    from app.repositories import tokens

    cand = seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    gate = seed_gate(session, cand.id, "base", passed=False, reasons=[POWER_REASON], report=INSUFFICIENT)
    plain = _promote(client, rm, cand.id)
    assert plain.status_code == 409
    (why,) = plain.json()["error"]["reasons"]
    assert "insufficient evidence" in why and "power 0.00" in why and "override_reason" in why
    for blank in ("", "  \n\t "):
        resp = _override(client, rm, cand.id, blank)
        assert resp.status_code == 422, resp.text
    for role in ("viewer", "service"):
        other = auth(make_token(session, role))
        assert _override(client, other, cand.id, "I have read the evals").status_code == 403
    # A role that may promote but not override is refused before anything is written.
    monkeypatch.setitem(tokens.PERMISSIONS, "release_manager", frozenset({"read", "reject", "promote"}))
    resp = _override(client, rm, cand.id, "I have read the evals")
    assert resp.status_code == 403 and "may not override" in resp.json()["error"]["message"]
    monkeypatch.undo()
    assert session.scalar(select(sa.func.count()).select_from(Promotion)) == 0
    assert {a.action for a in session.scalars(select(AuditLog))} == {"token.created"}

    resp = _override(client, rm, cand.id, "4 tasks cannot show it; the canary and the diff review can")
    assert resp.status_code == 201, resp.text
    assert _statuses(session) == {"base": "retired", cand.id: "production"}
    overridden = session.scalars(select(AuditLog).where(AuditLog.action == "gate.overridden")).one()
    assert overridden.actor == "alice" and overridden.target == f"checkpoint:{cand.id}"
    assert overridden.details["override_reason"] == "4 tasks cannot show it; the canary and the diff review can"
    assert overridden.details["decision"] == "insufficient_evidence"
    assert overridden.details["gate_decision_id"] == str(gate.id)
    assert overridden.details["suites"]["functions"] == {"decision": "insufficient_evidence", "power": 0.0}
    promoted = session.scalars(select(AuditLog).where(AuditLog.action == "checkpoint.promoted")).one()
    assert promoted.details["gate_decision"] == "insufficient_evidence"
    assert promoted.details["override_reason"] == overridden.details["override_reason"]
    msg = session.scalars(select(Outbox)).one()
    assert msg.event_type == "checkpoint.promoted" and msg.payload["gate_decision"] == "insufficient_evidence"
    latest = client.get(f"/v1/checkpoints/{cand.id}", headers=rm).json()["latest_gate"]
    assert latest["decision"] == "insufficient_evidence" and latest["passed"] is False
    me = client.get("/v1/me", headers=rm).json()
    assert "override" in me["permissions"]


def test_an_override_applies_to_insufficient_evidence_only(client, session, store, base, gated, rm):
    assert _override(client, rm, gated.id, "no need").status_code == 409  # the gate passed: nothing to override
    failed = seed_checkpoint(session, store, "ckpt-0002", parent_id="base", generation=1)
    seed_gate(session, failed.id, "base", passed=False, report={"decision": "fail", "suites": {}})
    resp = _override(client, rm, failed.id, "I trust it anyway")
    assert resp.status_code == 409
    reasons = resp.json()["error"]["reasons"]
    assert any("failed" in r for r in reasons) and any("applies only" in r for r in reasons)
    # A decision stored before the three-way gate (no "decision" in its report) is a failure.
    old = seed_checkpoint(session, store, "ckpt-0003", parent_id="base", generation=1)
    seed_gate(session, old.id, "base", passed=False)
    assert _override(client, rm, old.id, "I trust it anyway").status_code == 409
    assert session.scalar(select(sa.func.count()).select_from(Promotion)) == 0
    assert not session.scalars(select(AuditLog).where(AuditLog.action == "gate.overridden")).all()

"""Migration 0022 backfills the gate's decision as a column from what was stored before: each gate's
report (a report without a decision reads as pass or fail by ``passed``), the latest gate per
checkpoint, and ``overridden`` for a checkpoint promoted over its gate; the CHECK constraints then
refuse a status or a decision outside the enums; the downgrade takes the columns away again."""

from __future__ import annotations

import json
import uuid

import psycopg
import pytest

pytestmark = pytest.mark.integration


def test_decisions_are_backfilled_from_the_stored_reports_and_overrides(pg_admin_url):
    from app.core.db import reset_engines
    from app.core.migrate import downgrade, upgrade

    name = f"flywheel_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url=url, revision="0020")
        checkpoints = [  # (id, status)
            ("base", "retired"),
            ("old-pass", "gate_passed"),  # a gate stored before reports carried a decision
            ("weak", "gate_failed"),
            ("regated", "gate_passed"),  # failed first, then passed against the same production
            ("forced", "production"),  # promoted over insufficient evidence
            ("fresh", "candidate"),  # never gated
        ]
        gates = [  # (candidate, passed, report, seconds after the first)
            ("old-pass", True, {}, 0),
            ("weak", False, {"decision": "insufficient_evidence"}, 1),
            ("regated", False, {"decision": "fail"}, 2),
            ("regated", True, {"decision": "pass"}, 3),
            ("forced", False, {"decision": "insufficient_evidence"}, 4),
        ]
        with psycopg.connect(url) as conn:
            for cid, status in checkpoints:
                conn.execute(
                    "INSERT INTO checkpoint (id, status, path, stable, generation, manifest, metrics, "
                    "num_trajectories, trained_on_erased) VALUES (%s, %s, %s, true, 0, '{}', '{}', 0, false)",
                    (cid, status, f"/ckpt/{cid}"),
                )
            for cid, passed, report, dt in gates:
                conn.execute(
                    "INSERT INTO gate_decision (id, candidate_id, production_id, passed, reasons, report, created_at) "
                    "VALUES (%s, %s, 'base', %s, '[]', %s, now() + make_interval(secs => %s))",
                    (uuid.uuid4(), cid, passed, json.dumps(report), dt),
                )
            conn.execute(
                "INSERT INTO audit_log (actor, action, target, details) "
                "VALUES ('alice', 'gate.overridden', 'checkpoint:forced', '{}')"
            )
        upgrade(url=url)
        with psycopg.connect(url) as conn:
            got = dict(conn.execute("SELECT id, decision FROM checkpoint").fetchall())
            gate_decisions = conn.execute(
                "SELECT candidate_id, decision FROM gate_decision ORDER BY created_at"
            ).fetchall()
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("UPDATE checkpoint SET status = 'shipped' WHERE id = 'fresh'")
            conn.rollback()
            with pytest.raises(psycopg.errors.CheckViolation):
                conn.execute("UPDATE checkpoint SET decision = 'maybe' WHERE id = 'fresh'")
        downgrade(url=url, revision="0020")  # and back: the columns and constraints go, the rows stay
        with psycopg.connect(url) as conn:
            assert conn.execute("SELECT count(*) FROM gate_decision").fetchone() == (5,)
            columns = "SELECT count(*) FROM information_schema.columns WHERE column_name = 'decision'"
            assert conn.execute(columns + " AND table_name IN ('checkpoint', 'gate_decision')").fetchone() == (0,)
    finally:
        reset_engines()
        with psycopg.connect(pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    assert got == {
        "base": None,
        "old-pass": "pass",
        "weak": "insufficient_evidence",
        "regated": "pass",
        "forced": "overridden",
        "fresh": None,
    }
    assert gate_decisions == [
        ("old-pass", "pass"),
        ("weak", "insufficient_evidence"),
        ("regated", "fail"),
        ("regated", "pass"),
        ("forced", "insufficient_evidence"),
    ]

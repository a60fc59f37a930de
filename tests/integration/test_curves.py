"""The learning curve reads back what the loop stored: eval pass rates with Wilson intervals per
checkpoint, the product signals of the sessions each served, and which way the signals moved."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def _eval_run(session, checkpoint_id: str, outcomes: list[bool], errors: int = 0):
    from evals import store

    run = store.create_run(session, checkpoint_id, "functions", "v1", {})
    for i, ok in enumerate(outcomes):
        store.add_result(
            session,
            run.id,
            f"FN/t/{i}",
            0,
            passed=ok,
            attempts=0,
            turns=1,
            completion_tokens=50,
            latency_s=1.0,
            tool_calls=2,
            tool_call_errors=errors if i == 0 else 0,
            asked_question=False,
            edited=True,
        )
    store.finish_run(session, run, "succeeded", {})


def _served(session, checkpoint_id: str, rewards: list[float], accepted: list[bool], user: str):
    from app.models import Trajectory
    from trainer.testing import insert_trajectory, make_segment

    for r, ok in zip(rewards, accepted):
        tid = insert_trajectory(
            session, segments=[make_segment([1, 2], [3, 4])], reward=r, checkpoint_id=checkpoint_id, user_id=user
        )
        session.get(Trajectory, tid).signals = {
            "edits": {"e": {"decision": "accepted" if ok else "rejected", "persisted": 0.9 if ok else None}},
            "dissatisfied_followups": 0 if ok else 1,
        }
    session.flush()


def test_curve_points_follow_the_stored_evals_and_served_sessions(session, tmp_path):
    import uuid

    from app.models import Checkpoint, GateDecision
    from ops.curves import collect_curves, curves_html, render_curves_png, signal_moves

    session.add_all(
        [
            Checkpoint(id="base", path=str(tmp_path / "base"), status="retired", generation=0, stable=True),
            Checkpoint(
                id="c1",
                path=str(tmp_path / "c1"),
                status="production",
                generation=1,
                parent_id="base",
                stable=True,
                metrics={"steps": 2},
            ),
            Checkpoint(
                id="c1x",
                path=str(tmp_path / "c1x"),
                status="rejected",
                generation=1,
                parent_id="base",
                stable=True,
                metrics={"invert_reward": True},
            ),
        ]
    )
    session.flush()
    _eval_run(session, "base", [True, False, False, False], errors=1)
    _eval_run(session, "c1", [True, True, True, False])
    _served(session, "base", [0.0, -1.0], [False, False], "u1")
    _served(session, "base", [1.0], [True], "u2")
    _served(session, "c1", [1.0, 1.0, 0.0], [True, True, False], "u3")
    session.add(
        GateDecision(
            id=uuid.uuid4(),
            candidate_id="c1",
            production_id="base",
            passed=False,
            decision="insufficient_evidence",
            reasons=[],
            report={
                "decision": "insufficient_evidence",
                "suites": {
                    "functions": {"gated": True, "decision": "insufficient_evidence", "power": 0.31},
                    "functions_params": {"gated": False, "decision": "pass", "power": 0.9},
                },
            },
        )
    )
    session.commit()

    points = {p.checkpoint_id: p for p in collect_curves(session)}
    assert [p.checkpoint_id for p in collect_curves(session)][0] == "base"
    base, c1, planted = points["base"], points["c1"], points["c1x"]
    assert base.suites["functions"]["pass_rate"] == 0.25 and c1.suites["functions"]["pass_rate"] == 0.75
    assert base.suites["functions"]["low"] < 0.25 < base.suites["functions"]["high"]
    assert base.suites["functions"]["invalid_tool_call_rate"] == pytest.approx(1 / 8)
    assert base.signals["sessions"] == 3 and base.signals["edit_acceptance"] == pytest.approx(1 / 3)
    assert base.signals["mean_reward"] == pytest.approx(0.0) and c1.signals["mean_reward"] == pytest.approx(2 / 3)
    assert c1.signals["dissatisfied_followup_rate"] == pytest.approx(1 / 3)
    assert planted.invert_reward and planted.signals == {} and planted.suites == {}
    # Signals carry their interval clustered by user where two users define them (base: u1, u2).
    low, high = base.signal_ci["edit_acceptance"]
    assert low < base.signals["edit_acceptance"] < high and "edit_acceptance" not in c1.signal_ci
    # The gate view: the decision and each gated suite's decision and power.
    assert c1.gate == {
        "decision": "insufficient_evidence",
        "suites": {"functions": {"decision": "insufficient_evidence", "power": 0.31}},
    }
    assert base.gate == {} and "insufficient_evidence: functions insufficient_evidence (power 0.31)" in curves_html(
        list(points.values()), "curves.png"
    )
    moves = signal_moves(list(points.values()))
    assert moves["edit_acceptance"] == (pytest.approx(1 / 3), pytest.approx(2 / 3))
    assert render_curves_png(list(points.values()), tmp_path / "curves.png").stat().st_size > 0


def test_the_loop_report_json_carries_every_decision_with_power(session, tmp_path):
    import json
    import uuid

    from app.models import Checkpoint, GateDecision
    from ops.report import write_report

    session.add_all(
        [
            Checkpoint(id="base", path=str(tmp_path / "base"), status="production", generation=0, stable=True),
            Checkpoint(
                id="c1", path=str(tmp_path / "c1"), status="gate_failed", generation=1, parent_id="base", stable=True
            ),
        ]
    )
    session.flush()
    _eval_run(session, "base", [True, False, False, False])
    _eval_run(session, "c1", [True, True, False, False])
    suites = {
        "functions": {"gated": True, "decision": "insufficient_evidence", "power": 0.0, "margin": 0.045, "n_pairs": 4},
        "functions_params": {"gated": False, "decision": "insufficient_evidence", "power": 0.0},
    }
    session.add(
        GateDecision(
            id=uuid.uuid4(),
            candidate_id="c1",
            production_id="base",
            passed=False,
            decision="insufficient_evidence",
            reasons=[{"check": "power", "passed": False, "inconclusive": True, "message": "functions: power 0.00"}],
            report={"decision": "insufficient_evidence", "suites": suites},
        )
    )
    session.commit()
    report, html_path = write_report(session, tmp_path / "out", "c1")
    data = json.loads((tmp_path / "out" / "report.json").read_text())
    (gate,) = data["gates"]
    assert gate["candidate_id"] == "c1" and gate["decision"] == "insufficient_evidence"
    assert gate["suites"] == {
        "functions": {
            "decision": "insufficient_evidence",
            "power": 0.0,
            "margin": 0.045,
            "n_pairs": 4,
            "diff": None,
            "diff_low": None,
            "diff_high": None,
        }
    }
    assert data["gate_decision"] == "insufficient_evidence" and data["gate_reasons"][0].startswith("INSUFFICIENT")
    page = html_path.read_text()
    assert (
        "gate: insufficient_evidence" in page
        and "<td>functions</td><td>insufficient_evidence</td><td>0.00</td>" in page
    )
    assert (tmp_path / "out" / "curves.png").stat().st_size > 0

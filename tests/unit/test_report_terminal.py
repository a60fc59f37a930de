"""The loop report's and the learning curve's terminal tables fit 80 columns without cutting a name."""

from __future__ import annotations

import io

from rich.console import Console

from ops.curves import CurvePoint
from ops.report import LoopReport, SuiteResult
from ops.report_terminal import render_curves_terminal, render_terminal

CAND, PROD, PLANTED = "ckpt-20261120143055-a1b2c3", "ckpt-20261120120000-d4e5f6", "ckpt-20261120150512-0f9e8d"
SUITES = ("dataframebench", "functions", "functions_params", "humaneval", "mined")


def _console() -> Console:
    return Console(width=80, record=True, file=io.StringIO(), color_system=None)


def _report() -> LoopReport:
    report = LoopReport(
        generated_at="2026-11-20T15:00:00+00:00",
        events_by_type={"session.started": 128, "edit.decided": 512},
        dead_letters_by_reason={},
        privacy_events_dropped=3,
        trajectories_by_status={"finalized": 125},
        reward_spec="implicit@1",
        rewards=[0.0, 1.0, -1.0],
        candidate_id=CAND,
        candidate_parent_id=PROD,
        candidate_status="gate_failed",
        training_metrics={"loss": 0.42, "kl_to_reference": 0.013},
        trajectories_trained=125,
        production_id=PROD,
        gate_decision="insufficient_evidence",
        gate_reasons=["INSUFFICIENT  functions_params: power 0.22 to tell an equal candidate from one 4.5% worse"],
    )
    for ckpt in (CAND, PROD):
        for suite in SUITES:
            report.suites.append(
                SuiteResult(
                    ckpt, suite, 20, 112, 0.119, 0.26, 212.0, 3, samples_per_task=8, pass_at_k={"1": 0.52, "8": 0.813}
                )
            )
            report.suites[-1].best_of_k = 0.813
    decisions = ("insufficient_evidence", "fail", "pass", "insufficient_evidence", "pass")
    report.gates = [
        {
            "decision_id": "d",
            "candidate_id": CAND,
            "production_id": PROD,
            "decision": "fail",
            "suites": {
                s: {
                    "decision": d,
                    "power": 0.2235,
                    "margin": 0.045,
                    "n_pairs": 896,
                    "diff": -0.021,
                    "diff_low": -0.06,
                    "diff_high": 0.018,
                }
                for s, d in zip(SUITES, decisions)
            },
        }
    ]
    return report


def _points() -> list[CurvePoint]:
    suite = {"pass_rate": 0.179, "low": 0.119, "high": 0.26, "n": 112}
    gate = {
        "decision": "insufficient_evidence",
        "suites": {s: {"decision": "insufficient_evidence", "power": 0.22} for s in SUITES},
    }
    signals = {
        "sessions": 128.0,
        "mean_reward": 0.12,
        "edit_acceptance": 0.5,
        "edit_persistence": 0.4,
        "dissatisfied_followup_rate": 0.1,
        "latency_per_token": 0.02,
        "mean_completion_tokens": 77.0,
    }
    return [
        CurvePoint("base", 0, "retired", None, suites=dict.fromkeys(SUITES, suite), signals=signals),
        CurvePoint(PROD, 1, "production", "base", suites=dict.fromkeys(SUITES, suite), signals=signals, gate=gate),
        CurvePoint(CAND, 2, "gate_failed", PROD, suites=dict.fromkeys(SUITES, suite), gate=gate),
        CurvePoint(PLANTED, 1, "rejected", "base", invert_reward=True, suites=dict.fromkeys(SUITES, suite), gate=gate),
    ]


def _assert_fits(text: str, names: list[str]) -> None:
    lines = text.splitlines()
    assert max(len(line) for line in lines) <= 80
    assert "…" not in text and "..." not in text
    for name in names:
        assert name in text, name


def test_the_loop_report_fits_80_columns_with_every_name_whole():
    con = _console()
    render_terminal(_report(), con)
    text = con.export_text()
    _assert_fits(text, [CAND, PROD, *SUITES, "insufficient_evidence"])
    # The gate table says each suite's decision and power.
    row = next(line.split() for line in text.splitlines() if line.split()[:1] == ["functions"] and "0.22" in line)
    assert row == ["functions", "fail", "0.22", "4.5", "-2.1", "[-6.0,", "+1.8]"]


def test_the_learning_curve_fits_80_columns_with_every_name_whole():
    con = _console()
    render_curves_terminal(_points(), con)
    text = con.export_text()
    _assert_fits(text, [CAND, PROD, PLANTED, *SUITES, "insufficient_evidence", "gate_failed", "production"])
    assert "#3*" in text and "planted regression" in text


def test_the_report_reads_as_text_the_power_check_as_info_and_counts_never_as_a_dict():
    """Issue 70, item 6: the informational power figure is ``INFO``, not ``FAIL``; counts print as
    ``finalized 43``, never ``{"finalized": 43}``, in the terminal and in the HTML."""
    from ops.report import _reason_text

    power = {
        "check": "power",
        "suite": "functions",
        "passed": False,
        "informational": True,
        "message": "functions: power 0.22 to tell an equal candidate from one 4.5% worse at 112 pairs",
    }
    assert _reason_text(power).startswith("INFO  functions: power 0.22")
    assert _reason_text({**power, "informational": False}).startswith("FAIL")
    assert _reason_text({"check": "floor", "passed": True, "message": "ok"}) == "PASS  ok"
    report = _report()
    report.dead_letters_by_reason = {"schema": 2}
    report.trajectories_by_status = {"finalized": 43}
    con = _console()
    render_terminal(report, con)
    text = con.export_text()
    assert "trajectories: finalized 43;" in text and "dead letters: 2 (schema 2)" in text
    assert "{" not in text

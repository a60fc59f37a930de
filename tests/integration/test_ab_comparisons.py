"""Stored A/B results on real Postgres: ``flywheel ab`` writes one ``ab_comparison`` row per result,
``GET /v1/ab-comparisons`` reads them back newest first, and the dashboard has their section.

The A/B results are built by ``ops.ab.compare_arms`` from hand-made sessions (the shape ``flywheel ab
--json`` prints, without serving a model)."""

from __future__ import annotations

import json

import pytest
import sqlalchemy as sa
from sqlalchemy import select
from typer.testing import CliRunner

from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.core.settings import get_settings
from app.models import ABComparison
from app.repositories.ab_comparisons import record_ab_comparison
from ops import ab
from ops.ab import ABConfig, ArmRun, ArmSession, compare_arms, plan_pairs
from ops.cli import app as cli_app
from tests.integration.test_api_support import auth, client, make_token  # noqa: F401

pytestmark = pytest.mark.integration


def _report(final: str, base_passes: int, final_passes: int, seed: int = 0) -> dict:
    """What ``run_ab`` returns for 4 tasks x 2 samples: base passes the first ``base_passes`` pairs,
    ``final`` the first ``final_passes``; ``final`` persists more of its edits and writes fewer tokens."""
    config = ABConfig(split="test_params", tasks=4, samples=2, seed=seed, difficulty_mix={1: 1.0})
    pairs = plan_pairs(config)

    def arm(checkpoint_id: str, passes: int, persisted: float, tokens: int) -> ArmRun:
        run = ArmRun(checkpoint_id, ran=len(pairs))
        for i, (task, sample) in enumerate(pairs):
            ok = i < passes
            run.sessions[(task.id, sample)] = ArmSession(
                task_id=task.id,
                sample=sample,
                task_hash="h",
                checkpoint_id=checkpoint_id,
                passed=ok,
                outcome="passed" if ok else "failed",
                accepted=1,
                rejected=int(not ok),
                persisted_sum=persisted * (1 + i % 3) / 3,
                persisted_n=1,
                followups=int(not ok),
                completion_tokens=tokens + 10 * i,
                latency_s=1.5,
                turns=2,
                reason="done",
            )
        return run

    report = compare_arms(arm("base", base_passes, 0.4, 300), arm(final, final_passes, 0.8, 200), pairs)
    return {**report, "config": config.model_dump(mode="json")}


def test_ab_results_round_trip_through_the_api(client, session):
    first, second = _report("ckpt-1", 2, 3), _report("ckpt-2", 2, 7)
    with session_scope() as s:  # the boundary flywheel ab uses: one transaction per result
        record_ab_comparison(s, first, label="cycle-1", report_path="reports/ab/base-vs-ckpt-1.json")
    with session_scope() as s:
        record_ab_comparison(s, second, label="cycle-2")
    viewer = auth(make_token(session, "viewer"))

    resp = client.get("/v1/ab-comparisons", headers=viewer)
    assert resp.status_code == 200, resp.text
    items = resp.json()["items"]
    assert [(i["label"], i["checkpoint_id"], i["base_id"]) for i in items] == [
        ("cycle-2", "ckpt-2", "base"),
        ("cycle-1", "ckpt-1", "base"),
    ]
    got, want = items[0], second["metrics"]["pass_rate"]
    assert (got["pairs"], got["tasks"], got["samples"], got["confidence"]) == (8, 4, 2, 0.95)
    assert (got["base_pass_rate"], got["pass_rate"]) == (pytest.approx(2 / 8), pytest.approx(7 / 8))
    assert got["pass_rate_diff"] == pytest.approx(want["diff"]) == pytest.approx(5 / 8)
    assert [got["diff_ci_low"], got["diff_ci_high"]] == pytest.approx(want["ci"])
    assert got["diff_ci_low"] < got["pass_rate_diff"] < got["diff_ci_high"]
    assert got["pass_rate_lower_bound"] == pytest.approx(second["pass_rate_lower_bound"])
    assert got["diff_ci_low"] < got["pass_rate_lower_bound"] < got["pass_rate_diff"]
    # every signal with its intervals, as flywheel ab reported it (JSON lists for the intervals)
    assert got["metrics"] == json.loads(json.dumps(second["metrics"]))
    assert got["metrics"]["edit_persistence"]["final"] > got["metrics"]["edit_persistence"]["base"]
    assert got["metrics"]["mean_completion_tokens"]["diff"] == pytest.approx(-100)
    assert got["config"]["difficulty_mix"] == {"1": 1.0} and got["config"]["seed"] == 0
    assert got["detail"]["split"] == "test_params" and got["detail"]["error_count"] == 0

    page = client.get("/v1/ab-comparisons", headers=viewer, params={"limit": 1}).json()
    assert [i["label"] for i in page["items"]] == ["cycle-2"] and page["next_cursor"]
    rest = client.get("/v1/ab-comparisons", headers=viewer, params={"limit": 1, "cursor": page["next_cursor"]})
    assert [i["label"] for i in rest.json()["items"]] == ["cycle-1"] and rest.json()["next_cursor"] is None
    only = client.get("/v1/ab-comparisons", headers=viewer, params={"checkpoint_id": "ckpt-1"}).json()
    assert [i["label"] for i in only["items"]] == ["cycle-1"]


def test_bad_input_is_a_4xx_with_a_message(client, session):
    viewer = auth(make_token(session, "viewer"))
    assert client.get("/v1/ab-comparisons").status_code == 401
    for params in ({"limit": 0}, {"limit": 501}, {"cursor": "not-a-cursor"}, {"checkpoint_id": "bad id!"}):
        resp = client.get("/v1/ab-comparisons", headers=viewer, params=params)
        assert resp.status_code == 422, (params, resp.text)
        assert resp.json()["error"]["message"] and resp.json()["error"]["reasons"], params
    huge = "WzEwMDAwMDAwMDAwMDAwMDAwMDAwMDAwMF0"  # [100000000000000000000000]: beyond bigint
    for path in ("/v1/ab-comparisons", "/v1/audit"):  # one cursor rule for both id-keyed listings
        resp = client.get(path, headers=viewer, params={"cursor": huge})
        assert resp.status_code == 422 and resp.json()["error"]["reasons"], (path, resp.text)


def test_flywheel_ab_records_its_result_with_the_label(db, session, monkeypatch):
    report = _report("ckpt-3", 1, 4)
    monkeypatch.setattr(ab, "run_ab", lambda base, final, config, on_session=None: report)
    args = ["ab", "base", "ckpt-3", "--tasks", "4", "--samples", "2", "--label", "cycle-3", "--json"]
    result = CliRunner().invoke(cli_app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    printed = json.loads(result.output.strip().splitlines()[-1])
    row = session.get(ABComparison, printed["comparison_id"])
    assert (row.label, row.base_id, row.checkpoint_id, row.pairs) == ("cycle-3", "base", "ckpt-3", 8)
    assert row.pass_rate == pytest.approx(4 / 8) and row.report_path == printed["report_path"]

    too_long = CliRunner().invoke(cli_app, [*args[:-3], "--label", "x" * 129])
    assert too_long.exit_code == 2 and "128" in too_long.output
    unrecorded = CliRunner().invoke(cli_app, [*args[:-3], "--no-record", "--json"], catch_exceptions=False)
    assert unrecorded.exit_code == 0 and json.loads(unrecorded.output.strip().splitlines()[-1])["comparison_id"] is None
    assert session.scalar(select(sa.func.count()).select_from(ABComparison)) == 1


def test_flywheel_ab_without_a_database_stops_before_serving(monkeypatch):
    def never(*a, **k):
        raise AssertionError("the A/B ran although its result could not be stored")

    monkeypatch.setattr(ab, "run_ab", never)
    monkeypatch.delenv("FLYWHEEL_DATABASE_URL", raising=False)
    get_settings.cache_clear()
    with pytest.raises(ConfigurationError, match="no database configured"):
        CliRunner().invoke(cli_app, ["ab", "base", "ckpt-3"], catch_exceptions=False)


def test_the_dashboard_shows_the_fresh_traffic_curve(client):
    page = client.get("/").text
    assert '<section id="fresh">' in page and "Served checkpoint on fresh traffic" in page
    assert 'api("GET", "/v1/ab-comparisons?limit=50")' in page and "drawFresh()" in page
    for column in ("pass rate base → served", "edit persistence", "dissatisfied follow-ups", "tokens / session"):
        assert column in page

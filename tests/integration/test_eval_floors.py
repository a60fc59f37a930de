"""``flywheel eval floors`` against real Postgres: floors derived from a checkpoint's stored eval
results, the run it reads, ``--write`` into a copy of the shipped policy, and clear refusals."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from app.core.db import session_scope
from app.core.failures import ExitCode
from app.models import EvalResult, EvalRun
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from evals.config import load_suite
from evals.gate.checks import cluster_of
from evals.gate.floors import derive_floor
from evals.gate.policy import GATE_TOML, load_gate_config
from ops.cli import run

pytestmark = pytest.mark.integration

NOW = datetime.now(UTC)


@pytest.fixture
def home(tmp_path, monkeypatch):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.delenv("FLYWHEEL_EVAL_GATE_CONFIG", raising=False)
    return tmp_path


def seed_run(session, suite: str, results: dict[str, bool], *, config: dict, age_h: float, status="succeeded"):
    """A finished eval run of ``base`` with one greedy sample per task; flush."""
    run_row = EvalRun(
        id=uuid.uuid4(),
        checkpoint_id="base",
        suite=suite,
        suite_version="v",
        status=status,
        config=config,
        summary={},
        finished_at=NOW - timedelta(hours=age_h),
    )
    session.add(run_row)
    session.flush()
    session.add_all(EvalResult(run_id=run_row.id, task_id=t, sample_index=0, passed=p) for t, p in results.items())
    session.flush()
    return run_row


def functions_results() -> dict[str, bool]:
    """112 held-out-like tasks in 16 templates of 7; 19 pass, 1-3 in each of 9 templates."""
    passing = {f"FN/tpl{t:02d}/v{v}" for t, c in enumerate([3, 3, 3, 2, 2, 2, 2, 1, 1]) for v in range(c)}
    return {t: t in passing for t in (f"FN/tpl{t:02d}/v{v}" for t in range(16) for v in range(7))}


@pytest.fixture
def stored(db, home):
    policy = load_gate_config()
    planned = policy.plan_suite(load_suite("functions")).model_dump(mode="json")
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/x/base", status=CheckpointStatus.PRODUCTION)
        # the gate's plan (8 samples at T = 0.7): the run the floor must come from
        kept = seed_run(s, "functions", functions_results(), config={"suite": planned}, age_h=2)
        # newer, sampled otherwise (greedy, 1 sample: the plan before the gate was sized): not the gate's plan
        other = {**planned, "samples_per_task": 1, "sampling": {**planned["sampling"], "temperature": 0.0}}
        seed_run(s, "functions", {f"FN/tpl{t:02d}/v0": True for t in range(16)}, config={"suite": other}, age_h=1)
        # HumanEval: an older succeeded run and a newer one (no stored plan: the newest is read);
        # a failed run is never read
        seed_run(s, "humaneval", {f"HumanEval/{i}": i < 50 for i in range(164)}, config={}, age_h=5)
        seed_run(s, "humaneval", {f"HumanEval/{i}": i < 6 for i in range(164)}, config={}, age_h=3)
        seed_run(s, "humaneval", {f"HumanEval/{i}": True for i in range(164)}, config={}, age_h=0, status="failed")
        kept_id = str(kept.id)
    return kept_id


def test_floors_come_from_the_stored_results_and_write_keeps_the_rest(stored, home, capsys):
    path = home / "gate.toml"
    path.write_text(GATE_TOML.read_text())
    assert run(["eval", "floors", "--checkpoint", "base", "--config", str(path), "--json"]) == ExitCode.OK
    rows = {r["suite"]: r for r in map(json.loads, capsys.readouterr().out.splitlines())}
    assert set(rows) == {"dataframebench", "humaneval", "functions", "mined"}

    fn = rows["functions"]
    results = functions_results()
    expected = derive_floor(list(results.values()), [cluster_of(t, load_gate_config()) for t in results])
    assert fn["run_id"] == stored and fn["matches_plan"] is True
    assert (fn["estimate"]["passed"], fn["estimate"]["n"], fn["estimate"]["clusters"]) == (19, 112, 16)
    assert fn["estimate"]["design_effect"] > 1 and fn["estimate"]["floor"] == expected.floor == 0.065
    assert fn["estimate"]["floor"] < derive_floor([True] * 19 + [False] * 93).floor  # templates widen it
    assert fn["estimate"]["equal_refusal"] <= 0.01

    he = rows["humaneval"]["estimate"]
    assert (he["passed"], he["n"], he["floor"]) == (6, 164, 0.005) and rows["humaneval"]["matches_plan"] is False
    assert rows["dataframebench"]["estimate"] is None and rows["dataframebench"]["current"] == 0.0

    # the table, then --write: only the floor lines of suites with results change
    assert run(["eval", "floors", "--checkpoint", "base", "--config", str(path), "--write"]) == ExitCode.OK
    out = capsys.readouterr().out
    assert "dataframebench: base has no succeeded run of it" in out and "wrote 2 floor(s) to" in out
    policy = load_gate_config(path)
    assert policy.for_suite("functions").floor == expected.floor and policy.for_suite("humaneval").floor == 0.005
    assert policy.for_suite("dataframebench").floor == 0.0
    before, after = GATE_TOML.read_text().splitlines(), path.read_text().splitlines()
    changed = [b for a, b in zip(before, after, strict=True) if a != b]
    assert [line.split("#")[0].strip() for line in changed] == ["floor = 0.005", f"floor = {expected.floor}"]
    assert "base's run" in changed[0] and "6/164 passed" in changed[0]  # same number, new provenance
    assert f"base's run {stored[:8]}: 19/112 passed, deff 1.52" in changed[1] and "flywheel eval floors" in changed[1]


def test_bad_input_exits_with_a_message_and_no_traceback(stored, home, capsys):
    path = home / "gate.toml"
    path.write_text(GATE_TOML.read_text())
    assert run(["eval", "floors", "--checkpoint", "nope", "--config", str(path), "--write"]) == ExitCode.NEGATIVE
    err = capsys.readouterr().err
    assert "checkpoint 'nope' not found" in err and "Traceback" not in err
    assert path.read_text() == GATE_TOML.read_text()
    assert run(["eval", "floors", "--checkpoint", "base", "--config", str(path), "--suite", "nosuch"]) == ExitCode.USAGE
    assert "has no suite nosuch" in capsys.readouterr().err
    assert run(["eval", "floors", "--config", str(home / "missing.toml")]) == ExitCode.USAGE
    assert "not found" in capsys.readouterr().err


def test_the_production_checkpoint_is_the_default(stored, home, capsys):
    path = home / "gate.toml"
    path.write_text(GATE_TOML.read_text())
    assert run(["eval", "floors", "--config", str(path), "--suite", "humaneval", "--json"]) == ExitCode.OK
    row = json.loads(capsys.readouterr().out)
    assert row["checkpoint_id"] == "base" and row["estimate"]["passed"] == 6

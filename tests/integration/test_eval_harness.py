"""The runner on the real harness and sandbox: reference solutions pass through it with a scripted
agent, a do-nothing agent fails, a hostile hidden test stays contained, and ``flywheel eval`` runs
a real (tiny) model end to end."""

from __future__ import annotations

import os
import re
import threading

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.core.db import session_scope
from app.inference.engine import InferenceEngine
from app.models import EvalResult, EvalRun
from app.repositories.checkpoints import add_checkpoint
from evals import runner
from evals.config import SuiteConfig, load_suite
from evals.harness.scripted import ScriptedPolicy, tool_call
from evals.tasks import load_tasks
from evals.tasks.model import Task

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def _squash(text: str) -> str:
    return re.sub(r"\s+", "", text)


class Router(InferenceEngine):
    """One scripted policy per task, chosen by the task request in the prompt (thread-safe)."""

    def __init__(self, tokenizer, policies: dict[str, ScriptedPolicy], checkpoint_id: str = "scripted"):
        self.tokenizer = tokenizer
        self.checkpoint_id = checkpoint_id
        self.policies = {_squash(req)[:300]: p for req, p in policies.items()}
        self.lock = threading.Lock()

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            text = _squash(self.tokenizer.decode(prompt))
            (policy,) = [p for key, p in self.policies.items() if key in text]
            with self.lock:
                out += policy.generate([prompt], params)
        return out

    def load_checkpoint(self, checkpoint_id, path):
        self.checkpoint_id = checkpoint_id

    def apply_delta(self, checkpoint_id, delta_path, parent_id):
        self.checkpoint_id = checkpoint_id


@pytest.fixture
def ckpt(db):
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="scripted", path="/x/scripted")
    return "scripted"


def results_of(run_id: str) -> list[EvalResult]:
    import uuid

    with session_scope() as s:
        return list(
            s.scalars(select(EvalResult).where(EvalResult.run_id == uuid.UUID(run_id)).order_by(EvalResult.task_id))
        )


@pytest.mark.parametrize("source,n", [("humaneval", 4), ("dataframebench", 3)])
def test_reference_solutions_pass_through_the_runner(ckpt, tokenizer, source, n):
    suite = load_suite(source).with_overrides(limit=n, samples_per_task=1)
    tasks = load_tasks(source, suite.split, limit=n, seed=suite.seed)
    engine = Router(
        tokenizer,
        {t.request: ScriptedPolicy.submitting(tokenizer, t, run_command="python -c 'import solution'") for t in tasks},
    )
    summary = runner.run_suite(ckpt, suite, engine=engine, workers=2)
    assert summary.status == "succeeded" and summary.errors == []
    rows = results_of(summary.run_id)
    assert [r.task_id for r in rows] == sorted(t.id for t in tasks)
    failed = {r.task_id: r.detail.get("grade_output") for r in rows if not r.passed}
    assert failed == {}
    assert all(r.edited and r.tool_call_errors == 0 and r.attempts == 0 and r.turns >= 3 for r in rows), [
        (r.edited, r.tool_call_errors, r.attempts, r.turns, r.detail) for r in rows
    ]
    assert summary.pass_rate == 1.0 and summary.monitors["edit_rate"] == 1.0


def test_an_agent_that_does_nothing_fails_every_task(ckpt, tokenizer):
    tasks = load_tasks("humaneval", "test", limit=3, seed=5)
    engine = Router(tokenizer, {t.request: ScriptedPolicy(tokenizer, ["Which file should I change?"]) for t in tasks})
    summary = runner.run_suite(
        ckpt, SuiteConfig(name="humaneval", version="t", source="humaneval"), tasks=tasks, engine=engine
    )
    rows = results_of(summary.run_id)
    assert summary.passed == 0 and len(rows) == 3
    assert all(not r.passed and not r.edited and r.asked_question for r in rows)
    assert all(r.detail["grade_exit_code"] != 0 for r in rows)


HOSTILE_TEST = r"""
import glob, os, sys
escaped = []
for path in {targets!r}:
    try:
        with open(path, "a") as f:
            f.write("pwned")
        escaped.append("wrote " + path)
    except OSError as exc:
        print("blocked write", path, type(exc).__name__)
for path in {secrets!r} + glob.glob({work_glob!r}, recursive=True):
    try:
        print("read", path, open(path).read()[:20])
        escaped.append("read " + path)
    except OSError as exc:
        print("blocked read", path, type(exc).__name__)
with open("/tmp/flywheel-hostile-leftover", "w") as f:  # world-writable: allowed, swept afterwards
    f.write("x")
print("ESCAPED" if escaped else "CONTAINED", escaped)
sys.exit(0 if escaped else 1)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="file isolation uses a fresh unprivileged uid, which needs root")
def test_a_hostile_hidden_test_is_contained(ckpt, tokenizer, tmp_path, flywheel_home):
    other = tmp_path / "other-task"  # another task's private directory, as the runner creates them
    other.mkdir(mode=0o700)
    (other / "secret.py").write_text("API_KEY = 'hunter2'\n")
    victim_repo_file = str(flywheel_home / "evals" / "work" / "*" / "*" / "repo" / "solution.py")
    targets = [str(tmp_path / "escape.txt"), str(other / "secret.py"), str(flywheel_home / "escape.txt")]
    hostile = Task(
        id="evil/1",
        source="stub",
        split="test",
        request="Do the evil task.",
        files={"solution.py": "x = 1\n"},
        test_command="python test_evil.py",
        test_files={
            "test_evil.py": HOSTILE_TEST.format(
                targets=targets, secrets=[str(other / "secret.py")], work_glob=victim_repo_file
            )
        },
    )
    honest = load_tasks("humaneval", "test", limit=1, seed=1)[0]
    engine = Router(
        tokenizer,
        {
            hostile.request: ScriptedPolicy(tokenizer, [tool_call("finish", message="done")]),
            # The honest session is slow to finish, so its repository exists while the hostile test runs.
            honest.request: ScriptedPolicy.submitting(tokenizer, honest, run_command="sleep 3"),
        },
    )
    suite = SuiteConfig(name="isolation", version="t", source="humaneval")
    summary = runner.run_suite(ckpt, suite, tasks=[honest, hostile], engine=engine, workers=2)
    rows = {r.task_id: r for r in results_of(summary.run_id)}
    assert rows[honest.id].passed  # the honest task is unaffected
    assert not rows["evil/1"].passed
    output = rows["evil/1"].detail["grade_output"]
    assert "CONTAINED" in output and "blocked read" in output and "ESCAPED" not in output
    assert not (tmp_path / "escape.txt").exists() and not (flywheel_home / "escape.txt").exists()
    assert (other / "secret.py").read_text() == "API_KEY = 'hunter2'\n"
    assert not os.path.exists("/tmp/flywheel-hostile-leftover")


def test_flywheel_eval_runs_a_real_model_end_to_end(db, tiny_model_dir):
    """``flywheel eval CHECKPOINT --suite NAME`` with the reference engine on a tiny random model: it loads
    the checkpoint, runs sessions through the harness, grades, stores results and prints intervals."""
    from app.checkpoints.publish import publish_folder
    from ops.cli import app

    path = publish_folder(tiny_model_dir, "tiny", {"id": "tiny"})
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="tiny", path=str(path))
    args = [
        "eval",
        "tiny",
        "--suite",
        "humaneval",
        "--limit",
        "2",
        "--samples",
        "1",
        "--max-turns",
        "2",
        "--max-tokens",
        "24",
    ]
    result = CliRunner().invoke(app, args, catch_exceptions=False)
    assert result.exit_code == 0, result.output
    assert "humaneval" in result.output and "95% CI" in result.output
    with session_scope() as s:
        run = s.scalars(select(EvalRun)).one()
        assert run.status == "succeeded" and run.summary["done"] == 2
        assert run.config["suite"]["budget"]["max_turns"] == 2
    again = CliRunner().invoke(app, args + ["--json"], catch_exceptions=False)
    assert again.exit_code == 0 and '"cached": true' in again.output

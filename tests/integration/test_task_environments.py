"""Environments set up by the model: verified proposals are stored and reused, refused ones fall back with
their reason, and the success rate counts (real Postgres, the sandbox, a tiny model's tokenizer/weights)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from sqlalchemy import delete, select
from transformers import AutoTokenizer
from typer.testing import CliRunner

from app.inference.engine import Generation, InferenceEngine, SamplingParams
from app.models import EvalTask, TaskEnvironment
from evals.environment_setup import REPLY_PREFIX, environment_for, setup_environments
from evals.environments import EnvironmentPolicy, EnvironmentProposal
from evals.harness.agent import grade_result
from evals.harness.chat import repository_message
from evals.harness.environment import ENV_DIR, materialize_environment
from evals.harness.sandbox import SandboxLimits
from evals.harness.scripted import ScriptedPolicy
from evals.harness.toolcalls import ParsedCall
from evals.harness.tools import execute_tool
from evals.harness.workspace import write_files
from evals.tasks.mined import load_mined_tasks, preferred_verified_environment, verified_environments
from ops.cli import app
from tests.unit.test_environments import DATA_TASK, NUMPY_TASK

pytestmark = pytest.mark.integration

POLICY = EnvironmentPolicy(allowed=("numpy", "pandas"), timeout_s=60)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Counting(InferenceEngine):
    """Wraps an engine and counts the prompts it was asked to complete."""

    def __init__(self, inner: InferenceEngine) -> None:
        self.inner, self.tokenizer, self.checkpoint_id, self.prompts = inner, inner.tokenizer, "counted", 0

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        self.prompts += len(prompts)
        return self.inner.generate(prompts, params)

    def load_checkpoint(self, checkpoint_id, path) -> None:
        raise NotImplementedError

    def apply_delta(self, checkpoint_id, delta_path, parent_id) -> None:
        raise NotImplementedError


def rows(session) -> list[TaskEnvironment]:
    return list(session.scalars(select(TaskEnvironment).order_by(TaskEnvironment.task_id, TaskEnvironment.origin)))


def test_a_parsed_proposal_is_verified_stored_and_reused_without_a_model_call(session, tokenizer):
    answer = '"numpy"], "files": {}}'  # the model continues REPLY_PREFIX
    engine = Counting(ScriptedPolicy(tokenizer, [answer]))
    first = setup_environments(session, [NUMPY_TASK], engine, POLICY)
    session.commit()
    assert (first.proposed, first.parsed, first.verified, first.fallbacks, first.success_rate) == (1, 1, 1, 0, 1.0)
    [row] = rows(session)
    assert row.origin == "model" and row.verified and row.reason is None and row.proposal["dependencies"] == ["numpy"]
    assert environment_for(session, NUMPY_TASK, POLICY) == EnvironmentProposal(dependencies=["numpy"], files={})

    again = Counting(ScriptedPolicy(tokenizer, []))
    second = setup_environments(session, [NUMPY_TASK], again, POLICY)
    assert again.prompts == 0  # the cache answered: no model call
    assert (second.cached, second.proposed, second.success_rate) == (1, 0, None)
    assert second.outcomes[0]["env_hash"] == row.env_hash and len(rows(session)) == 1


def test_refused_proposals_fall_back_with_their_reason_and_the_rate_counts_them(session, tokenizer):
    tasks = [
        NUMPY_TASK,
        NUMPY_TASK.model_copy(
            update={
                "id": "env/numpy-2",
                "test_files": {"test_hidden.py": "from solution import *\nassert mean([4]) == 4.0\n"},
            }
        ),
        NUMPY_TASK.model_copy(update={"id": "env/numpy-3", "test_command": "python3 test_hidden.py"}),
        DATA_TASK,
    ]
    replies = [
        '"numpy"], "files": {}}',  # right (continuing REPLY_PREFIX)
        '], "files": {}}',  # parses, but the reference cannot import numpy
        "numpy and pandas, you will need them.",  # prose
        '"torch"], "files": {}}',  # not allowed
    ]
    report = setup_environments(session, tasks, ScriptedPolicy(tokenizer, replies), POLICY)
    session.commit()
    assert (report.proposed, report.parsed, report.verified) == (4, 2, 1)
    assert report.success_rate == pytest.approx(0.25)
    assert report.fallbacks == 3 and report.fallback_verified == 2 and report.unverified == 1
    assert report.reasons == {"reference_failed": 1, "unparseable": 1, "dependency_not_allowed": 1}
    by_id = {(r.task_id, r.origin): r for r in rows(session)}
    assert not by_id["env/numpy-2", "model"].verified and by_id["env/numpy-2", "model"].reason == "reference_failed"
    fallback = by_id["env/numpy-2", "fallback"]
    assert fallback.verified and fallback.proposal["dependencies"] == ["numpy"]
    assert fallback.reason.startswith("reference_failed: ModuleNotFoundError")
    assert by_id["env/numpy-3", "fallback"].reason.startswith("unparseable")
    assert by_id["env/numpy-3", "fallback"].detail["model_reply"] == REPLY_PREFIX + replies[2]
    # the data file lived only in the session: no resolver can invent it, and the row says why
    data = by_id["env/data-file", "fallback"]
    assert not data.verified and data.reason.startswith("dependency_not_allowed: torch")
    assert environment_for(session, DATA_TASK, POLICY) is None


def test_a_random_tiny_model_falls_back_and_the_cli_reports_it(db, tiny_model_dir, session):
    result = CliRunner().invoke(
        app,
        [
            "tasks",
            "setup-envs",
            "--source",
            "functions",
            "--split",
            "test",
            "--limit",
            "2",
            "--model-dir",
            str(tiny_model_dir),
            "--engine",
            "reference",
            "--max-tokens",
            "24",
            "--verbose",
        ],
    )
    assert result.exit_code == 0, result.output
    summary = json.loads(result.output.strip().splitlines()[-1])
    assert summary["proposed"] == 2 and summary["verified"] == 0 and summary["success_rate"] == 0.0
    assert summary["fallbacks"] == 2 and summary["fallback_verified"] == 2
    assert summary["reasons"] and set(summary["reasons"]) <= {"unparseable", "invalid_schema", "dependency_not_allowed"}
    assert "fell back" in result.output
    stored = rows(session)
    assert len(stored) == 2 and all(r.origin == "fallback" and r.verified and r.reason for r in stored)

    again = CliRunner().invoke(
        app,
        [
            "tasks",
            "setup-envs",
            "--source",
            "functions",
            "--split",
            "test",
            "--limit",
            "2",
            "--model-dir",
            str(tiny_model_dir),
            "--engine",
            "reference",
        ],
    )
    assert json.loads(again.output.strip().splitlines()[-1])["cached"] == 2


def test_a_mined_tasks_environment_goes_with_it(session, tokenizer):
    mined = NUMPY_TASK.model_copy(update={"id": "mined/env-1", "source": "mined"})
    session.add(EvalTask(task_id=mined.id, suite="mined", content_hash="h" * 64, spec=mined.model_dump(mode="json")))
    session.flush()
    setup_environments(session, [mined], ScriptedPolicy(tokenizer, ['"numpy"], "files": {}}']), POLICY)
    session.commit()
    assert [(r.eval_task_id, r.origin) for r in rows(session)] == [(mined.id, "model")]
    session.execute(delete(EvalTask).where(EvalTask.task_id == mined.id))  # as an erasure does
    session.commit()
    assert rows(session) == []
    again = setup_environments(session, [mined], ScriptedPolicy(tokenizer, []), POLICY)
    assert (again.erased, again.proposed, rows(session)) == (1, 0, [])


def test_the_mined_suite_loads_each_tasks_preferred_environment_in_one_lookup(session):
    """``verified_environments`` gives, for many tasks at once, the row ``preferred_verified_environment``
    gives for each: a model's verified proposal before the fallback's, unverified rows never, a task
    without a verified row absent; ``load_mined_tasks`` loads only verified tasks, each with its own."""
    ids = [f"mined/batch-{i}" for i in range(3)]
    for i, task_id in enumerate(ids):
        spec = NUMPY_TASK.model_copy(update={"id": task_id, "source": "mined"}).model_dump(mode="json")
        session.add(EvalTask(task_id=task_id, suite="mined", content_hash=f"{i}" * 64, spec=spec))
    session.flush()

    def env(n: int, task_id: str, origin: str, verified: bool, dependency: str) -> TaskEnvironment:
        proposal = {"dependencies": [dependency], "files": {}}
        return TaskEnvironment(
            env_hash=f"{n:064d}", task_key="k" * 64, task_id=task_id, source="mined", eval_task_id=task_id,
            origin=origin, proposal=proposal, verified=verified,
        )  # fmt: skip

    session.add_all(
        [
            env(1, ids[0], "fallback", True, "numpy"),  # stored first, but a model's row comes first
            env(2, ids[0], "model", True, "pandas"),
            env(3, ids[1], "model", False, "scipy"),  # never verified: not used
            env(4, ids[1], "fallback", True, "numpy"),
            env(5, ids[2], "model", False, "scipy"),  # no verified row: the task is not gated on
        ]
    )
    session.flush()

    batched = verified_environments(session, ids)
    assert {k: v.env_hash for k, v in batched.items()} == {
        task_id: e.env_hash
        for task_id in ids
        if (e := preferred_verified_environment(session, TaskEnvironment.eval_task_id == task_id)) is not None
    }
    assert {k: v.proposal["dependencies"] for k, v in batched.items()} == {ids[0]: ["pandas"], ids[1]: ["numpy"]}
    assert verified_environments(session, []) == {}
    loaded = {t.id: t.environment for t in load_mined_tasks(session) if t.id in ids}
    assert loaded == {ids[0]: ("pandas",), ids[1]: ("numpy",)}
    session.rollback()


def test_a_mined_task_runs_and_is_graded_in_its_verified_environment(session, tokenizer, tmp_path):
    """The gate's load of a mined task carries the environment that verified it: its distributions
    (a virtualenv of exactly those, in the session's repository and in the graded copy) and its
    files. Inside it the host's other packages are gone: a solution importing pandas, which this
    host has, fails where the environment names numpy only, on the agent's runs as on the grade."""
    mined = DATA_TASK.model_copy(update={"id": "mined/env-2", "source": "mined"})
    session.add(EvalTask(task_id=mined.id, suite="mined", content_hash="h" * 64, spec=mined.model_dump(mode="json")))
    session.flush()
    proposal = '"numpy"], "files": {"fixtures/cases.json": "[[1, 2], [3, 6]]"}}'
    setup_environments(session, [mined], ScriptedPolicy(tokenizer, [proposal]), POLICY)
    session.commit()
    assert [(r.eval_task_id, r.verified) for r in rows(session)] == [(mined.id, True)]

    (task,) = load_mined_tasks(session)
    assert task.environment == ("numpy",) and task.files["fixtures/cases.json"] == "[[1, 2], [3, 6]]"
    assert load_mined_tasks(session, verified_only=False)[0].environment is None  # as mined, for set-up

    def repo(name: str, solution: str) -> Path:
        path = tmp_path / name
        write_files(path, {**task.files, "solution.py": solution})
        return path

    assert grade_result(task, repo("reference", task.reference_files["solution.py"])).ok
    with_pandas = "import pandas\n\n\ndef double(x):\n    return 2 * x\n"
    graded = grade_result(task, repo("pandas", with_pandas))
    assert not graded.ok and "No module named 'pandas'" in graded.stderr, graded.stderr[-600:]
    bare = task.model_copy(update={"environment": None})  # no environment: the standard library only
    assert "No module named 'pandas'" in grade_result(bare, repo("host", with_pandas)).stderr
    assert grade_result(bare, repo("allowed", with_pandas), SandboxLimits(packages=("pandas",))).ok

    # the agent's own test runs: the session's repository holds the environment, the run tool uses it
    workdir = repo("session", with_pandas)
    materialize_environment(workdir, task.environment)
    run = ParsedCall("run", {"command": "python test_hidden.py"}, True, None)
    write_files(workdir, task.test_files)
    outcome = execute_tool(run, workdir, SandboxLimits(timeout_s=60))
    assert not outcome.ok and "No module named 'pandas'" in outcome.output
    assert ENV_DIR not in repository_message(task.request, workdir)  # the links never reach the prompt

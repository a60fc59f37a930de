"""Task sources: the one format, split rules, and reference solutions that pass in the sandbox."""

from __future__ import annotations

import pytest

from app.core.errors import ConfigurationError
from evals.config import source_packages
from evals.harness.agent import grade
from evals.harness.sandbox import SandboxLimits
from evals.tasks import load_tasks, verify_reference
from evals.tasks.model import Task


def test_humaneval_all_references_pass_and_stubs_fail():
    tasks = load_tasks("humaneval", "test")
    assert len(tasks) == 164 and len({t.id for t in tasks}) == 164
    failing = [t.id for t in tasks if not verify_reference(t).ok]
    assert failing == []
    stub = verify_reference(tasks[0].model_copy(update={"reference_files": {}}))
    assert not stub.ok  # the bare signature does not pass: the check is real


@pytest.mark.parametrize("split,n", [("train", 6), ("test", 3)])
def test_dataframebench_sample_references_pass(split, n):
    tasks = load_tasks("dataframebench", split, limit=n, seed=11)
    assert len(tasks) == n and all(t.split == split and t.source == "dataframebench" for t in tasks)
    limits = SandboxLimits(timeout_s=60, packages=source_packages("dataframebench"))  # the suite's allow-list
    for task in tasks:
        result = verify_reference(task, limits)
        assert result.ok, (task.id, result.stderr[-2000:])
        assert "import pandas as pd" in task.files["solution.py"]


def test_dataframebench_splits():
    assert len(load_tasks("dataframebench", "train")) == 709
    assert len(load_tasks("dataframebench", "test")) == 100
    with pytest.raises(ConfigurationError, match="val split is never used"):
        load_tasks("dataframebench", "val")
    with pytest.raises(ConfigurationError, match="only a test split"):
        load_tasks("humaneval", "train")
    with pytest.raises(ConfigurationError, match="unknown task source"):
        load_tasks("swebench", "test")


def test_limit_is_a_seeded_subset_sorted_by_id():
    a = load_tasks("dataframebench", "train", limit=5, seed=3)
    assert [t.id for t in a] == [t.id for t in load_tasks("dataframebench", "train", limit=5, seed=3)]
    assert [t.id for t in a] == sorted(t.id for t in a)
    assert [t.id for t in a] != [t.id for t in load_tasks("dataframebench", "train", limit=5, seed=4)]


def test_task_round_trips_as_json_and_refuses_escaping_paths():
    task = load_tasks("humaneval", "test", limit=1)[0]
    assert Task.model_validate(task.model_dump(mode="json")) == task
    with pytest.raises(ValueError, match="inside the repository"):
        task.model_copy(update={}).model_validate({**task.model_dump(), "files": {"../x.py": ""}})


def test_hidden_tests_override_agent_files(tmp_path):
    task = load_tasks("humaneval", "test", limit=1)[0]
    from evals.harness.workspace import write_files

    write_files(tmp_path, {**task.reference_files, "test_hidden.py": "pass\n"})  # the agent "wrote" a fake test
    assert grade(task, tmp_path)
    write_files(tmp_path, {**task.files, "test_hidden.py": "pass\n"})
    assert not grade(task, tmp_path)  # the real hidden test runs, not the agent's copy

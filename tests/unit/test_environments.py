"""Task environments: strict parsing of a proposal, the import resolver, and verification in the sandbox
(a real virtualenv that exposes only the proposed distributions)."""

from __future__ import annotations

import json

import pytest

from evals.environment_imports import imported_modules, resolve_environment
from evals.environments import (
    ENV_DIR,
    EnvironmentPolicy,
    EnvironmentProposal,
    environment_hash,
    parse_proposal,
    task_key,
    verify_environment,
)
from evals.tasks.model import Task

POLICY = EnvironmentPolicy(allowed=("numpy", "Pandas", "definitely-not-installed-dist"), max_files=2, timeout_s=60)

NUMPY_TASK = Task(
    id="env/numpy-mean",
    source="handmade",
    split="test",
    request="add mean(xs)",
    files={"solution.py": "def mean(xs):\n    raise NotImplementedError\n"},
    reference_files={"solution.py": "import numpy as np\n\n\ndef mean(xs):\n    return float(np.mean(xs))\n"},
    test_files={"test_hidden.py": "from solution import mean\n\nassert mean([1, 2, 3]) == 2.0\n"},
    test_command="python test_hidden.py",
)

DATA_TASK = Task(
    id="env/data-file",
    source="handmade",
    split="test",
    request="add double(x)",
    files={"solution.py": "def double(x):\n    return x\n"},
    reference_files={"solution.py": "def double(x):\n    return 2 * x\n"},
    test_files={
        "test_hidden.py": (
            "import json\nfrom solution import double\n\n"
            "cases = json.load(open('fixtures/cases.json'))\nassert all(double(a) == b for a, b in cases)\n"
        )
    },
    test_command="python test_hidden.py",
)


def reply(dependencies, files=None) -> str:
    return json.dumps({"dependencies": dependencies, "files": files or {}})


def test_a_bare_or_fenced_json_object_parses_to_the_canonical_proposal():
    bare = parse_proposal(reply(["pandas", "NumPy", "numpy"]), NUMPY_TASK, POLICY)
    fenced = parse_proposal("```json\n" + reply(["numpy", "pandas"]) + "\n```\n", NUMPY_TASK, POLICY)
    assert bare.reason is None and bare.proposal == EnvironmentProposal(dependencies=["numpy", "pandas"], files={})
    assert fenced.proposal == bare.proposal


@pytest.mark.parametrize(
    "text, reason",
    [
        ("Sure! Here is the environment: " + reply(["numpy"]), "unparseable"),
        (reply(["numpy"]) + "\nThis installs numpy.", "unparseable"),
        ("```json\n" + reply(["numpy"]) + "\n```\nand\n```\n{}\n```", "unparseable"),
        ('{"dependencies": ["numpy"], "files": {}', "unparseable"),
        ('{"dependencies": ["numpy"]}', "invalid_schema"),
        ('{"dependencies": "numpy", "files": {}}', "invalid_schema"),
        ('{"dependencies": [], "files": {}, "python": "3.11"}', "invalid_schema"),
        ('{"dependencies": [1], "files": {}}', "invalid_schema"),
        (reply(["torch"]), "dependency_not_allowed"),
        (reply(["numpy[dev]"]), "dependency_not_allowed"),
        (reply(["definitely-not-installed-dist"]), "dependency_not_installed"),
        (reply([], {"conftest.py": "import os"}), "forbidden_file"),
        (reply([], {"sitecustomize.txt": ""}), "forbidden_file"),
        (reply([], {"x.pth": "import os"}), "forbidden_file"),
        (reply([], {"solution.py/extra.txt": ""}), "forbidden_file"),
        (reply([], {"test_hidden.py": ""}), "forbidden_file"),
        (reply([], {"../outside.txt": ""}), "forbidden_file"),
        (reply([], {"/etc/passwd": ""}), "forbidden_file"),
        (reply([], {f"{ENV_DIR}/pyvenv.cfg": ""}), "forbidden_file"),
        (reply([], {"a.txt": "", "b.txt": "", "c.txt": ""}), "too_many_files"),
    ],
)
def test_anything_else_is_refused_with_its_reason(text, reason):
    parsed = parse_proposal(text, NUMPY_TASK, POLICY)
    assert parsed.proposal is None
    assert parsed.reason == reason, parsed.detail


def test_the_environment_exposes_only_what_it_names():
    with_numpy = verify_environment(NUMPY_TASK, EnvironmentProposal(dependencies=["numpy"], files={}), POLICY)
    bare = verify_environment(NUMPY_TASK, EnvironmentProposal(dependencies=[], files={}), POLICY)
    assert with_numpy.verified and with_numpy.reason is None
    assert any(r.startswith("numpy==") for r in with_numpy.detail["resolved"])
    assert with_numpy.detail["stub_passes"] is False  # the stub still fails: the tests discriminate
    assert not bare.verified and bare.reason == "reference_failed"
    assert "No module named 'numpy'" in bare.detail["stderr_tail"]


def test_proposed_files_are_part_of_the_environment():
    cases = {"fixtures/cases.json": "[[1, 2], [3, 6]]"}
    assert verify_environment(DATA_TASK, EnvironmentProposal(dependencies=[], files=cases), POLICY).verified
    missing = verify_environment(DATA_TASK, EnvironmentProposal(dependencies=[], files={}), POLICY)
    assert not missing.verified and "FileNotFoundError" in missing.detail["stderr_tail"]


def test_the_resolver_maps_imports_to_allowed_installed_distributions():
    task = NUMPY_TASK.model_copy(
        update={
            "test_files": {
                **NUMPY_TASK.test_files,
                # code in a string (a hidden-test runner's prelude), a task module, the stdlib, a module
                # only the closure provides, and one nothing allowed provides
                "_run.py": "import sys\nsrc = 'import pandas\\n'\nimport solution, json, dateutil\nimport yaml\n",
            }
        }
    )
    proposal, detail = resolve_environment(task, POLICY)
    assert proposal.dependencies == ["numpy", "pandas"] and proposal.files == {}
    assert detail["modules"] == ["dateutil", "numpy", "pandas", "yaml"]
    assert detail["unresolved"] == ["yaml"]
    assert verify_environment(NUMPY_TASK, resolve_environment(NUMPY_TASK, POLICY)[0], POLICY).verified


def test_imports_of_unparsable_files_are_reported_not_guessed():
    names, broken = imported_modules({"ok.py": "from numpy import linalg\nfrom . import sibling\n", "bad.py": "def ("})
    assert names == {"numpy"} and broken == ["bad.py"]


def test_hashes_follow_content_not_spelling():
    key = task_key(NUMPY_TASK, POLICY)
    a = EnvironmentProposal(dependencies=["Pandas", "numpy"], files={"b": "1", "a": "2"})
    b = EnvironmentProposal(dependencies=["numpy", "pandas", "pandas"], files={"a": "2", "b": "1"})
    assert environment_hash(key, a) == environment_hash(key, b)
    assert task_key(NUMPY_TASK.model_copy(update={"request": "other words"}), POLICY) == key
    assert task_key(NUMPY_TASK, POLICY.model_copy(update={"allowed": ("numpy",)})) != key
    assert task_key(DATA_TASK, POLICY) != key

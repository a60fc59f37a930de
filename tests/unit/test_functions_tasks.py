"""The ``functions`` task source: deterministic, split by template, references pass, stubs fail."""

from __future__ import annotations

import random
import re
import statistics
from collections import Counter

import pytest

from app.core.errors import ConfigurationError
from evals.tasks import SOURCES, load_tasks, verify_reference, verify_stub
from evals.tasks.functions import held_out_templates
from evals.tasks.functions_spec import FRESH_TEMPLATES, TEMPLATES
from evals.tasks.model import Task

SPLITS = ("train", "test", "test_params", "report", "fresh", "fresh_hard")


@pytest.fixture(scope="module")
def splits() -> dict[str, list[Task]]:
    return {s: load_tasks("functions", s) for s in SPLITS}


def test_generation_is_deterministic(splits):
    from evals.tasks import functions

    functions._all.cache_clear()  # rebuild from the templates, not from the cache
    again = {s: load_tasks("functions", s) for s in SPLITS}
    assert {s: [t.model_dump() for t in ts] for s, ts in again.items()} == {
        s: [t.model_dump() for t in ts] for s, ts in splits.items()
    }


def test_counts_families_and_difficulties(splits):
    assert "functions" in SOURCES
    assert len(TEMPLATES) >= 60 and len({t.key for t in TEMPLATES}) == len(TEMPLATES)
    every = [t for ts in splits.values() for t in ts]
    assert len(every) >= 300 and len({t.id for t in every}) == len(every)
    assert len(splits["test"]) >= 48 and len(splits["test_params"]) >= 30 and len(splits["train"]) >= 150
    for ts in splits.values():
        assert set(Counter(t.metadata["difficulty"] for t in ts)) == {1, 2, 3}
        assert set(Counter(t.metadata["family"] for t in ts)) == {"strings", "parsing", "lists", "numbers", "dicts"}
    # distinct requests: parameterisations differ in name, constants or wording of the behaviour
    assert len({t.request for t in every}) == len(every)


def test_splits_are_disjoint_by_template(splits):
    templates = {s: {t.metadata["template"] for t in ts} for s, ts in splits.items()}
    assert templates["test"] == held_out_templates()
    assert not templates["test"] & (templates["train"] | templates["test_params"])
    assert templates["test_params"] <= templates["train"]  # unseen parameters of seen templates
    assert templates["fresh_hard"] == {t.key for t in FRESH_TEMPLATES}
    held = [templates[s] for s in ("test", "report", "fresh", "fresh_hard")]
    assert not set().union(*held) & (templates["train"] | templates["test_params"])
    assert sum(map(len, held)) == len(set().union(*held))  # pairwise disjoint
    train_fns = {
        (t.metadata["template"], t.metadata["entry_point"], t.request.split(" For example")[0]) for t in splits["train"]
    }
    for t in splits["test_params"]:
        assert t.metadata["variant"] >= 4 and t.split == "test_params"
        assert (t.metadata["template"], t.metadata["entry_point"], t.request.split(" For example")[0]) not in train_fns


def test_task_shape(splits):
    task = splits["test"][0]
    entry = task.metadata["entry_point"]
    assert task.files["solution.py"].startswith(f"def {entry}(") and "NotImplementedError" in task.files["solution.py"]
    assert f"`{entry}(" in task.request and "For example" in task.request
    assert Task.model_validate(task.model_dump(mode="json")) == task
    with pytest.raises(ConfigurationError, match="splits train, test, test_params"):
        load_tasks("functions", "val")


def test_sampled_references_pass_and_stubs_fail(splits):
    rng = random.Random(7)
    sample = [t for ts in splits.values() for t in rng.sample(ts, 6)]
    for task in sample:
        ref = verify_reference(task)
        assert ref.ok, (task.id, ref.stderr[-1500:])
        assert not verify_stub(task).ok, task.id


def test_a_wrong_solution_fails_the_hidden_tests(splits):
    task = next(t for ts in splits.values() for t in ts if t.metadata["template"] == "is_leap")
    entry = task.metadata["entry_point"]
    wrong = task.model_copy(
        update={"reference_files": {"solution.py": f"def {entry}(year):\n    return year % 4 == 0\n"}}
    )
    result = verify_reference(wrong)
    assert not result.ok and "expected" in result.stderr


def _hidden_check(task: Task):
    """The task's hidden ``check(candidate)``, loaded in-process from its test file."""
    namespace: dict = {}
    exec(task.test_files["test_hidden.py"], namespace)
    return namespace["check"]


def _reference_fn(task: Task):
    namespace: dict = {}
    exec(task.reference_files["solution.py"], namespace)
    return namespace[task.metadata["entry_point"]]


def test_unseen_parameters_are_not_renamed_training_tasks(splits):
    """What the simulator trains on (``train``) never solves a ``test_params`` task: every training
    variant's reference of the same template fails its hidden test, so each task's parameters
    (constants, separators, conditions) are new, not only its function name."""
    train_by_template: dict[str, list[Task]] = {}
    for t in splits["train"]:
        train_by_template.setdefault(t.metadata["template"], []).append(t)
    for task in splits["test_params"]:
        check = _hidden_check(task)
        check(_reference_fn(task))  # its own reference passes
        for seen in train_by_template[task.metadata["template"]]:
            with pytest.raises(Exception):  # any failure: a wrong value or a rejected input
                check(_reference_fn(seen))
    # and no two unseen-parameter tasks of a template share their behaviour either
    for a in splits["test_params"]:
        for b in splits["test_params"]:
            if a is not b and a.metadata["template"] == b.metadata["template"] and a.id < b.id:
                with pytest.raises(Exception):
                    _hidden_check(b)(_reference_fn(a))


def _tokens(text: str) -> list[str]:
    return re.findall(r"\w+|[^\w\s]", text)


def _edit_distance(a: list[str], b: list[str]) -> int:
    """Levenshtein distance between two token lists (insert, delete, substitute: 1 each)."""
    prev = list(range(len(b) + 1))
    for i, x in enumerate(a, 1):
        cur = [i]
        for j, y in enumerate(b, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (x != y)))
        prev = cur
    return prev[-1]


def _nearest_trained(tasks: list[Task], train: list[Task]) -> tuple[list[int], list[int]]:
    """Per task, the token edit distance of its reference (code) and of its request (without the
    example) to the nearest trained task's."""
    trained = [(_tokens(t.reference_files["solution.py"]), _tokens(t.request.split(" For example")[0])) for t in train]
    refs, reqs = [], []
    for t in tasks:
        ref, req = _tokens(t.reference_files["solution.py"]), _tokens(t.request.split(" For example")[0])
        refs.append(min(_edit_distance(ref, r) for r, _ in trained))
        reqs.append(min(_edit_distance(req, q) for _, q in trained))
    return refs, reqs


def test_fresh_requests_are_not_few_token_edits_of_trained_ones(splits):
    """Issue 59: most ``test_params`` tasks are a one- or two-token edit of a trained one (median
    nearest reference 2 code tokens away); every ``fresh_hard`` task's reference is at least 6 code
    tokens and its request at least 10 word tokens from every trained task's (the ``fresh`` split's
    distance is pinned in code skeletons: tests/unit/test_functions_splits.py)."""
    params_refs, _ = _nearest_trained(splits["test_params"], splits["train"])
    assert min(params_refs) == 1 and statistics.median(params_refs) <= 2
    refs, reqs = _nearest_trained(splits["fresh_hard"], splits["train"])
    assert min(refs) >= 6 and min(reqs) >= 10, (min(refs), min(reqs))
    assert statistics.median(refs) >= 10

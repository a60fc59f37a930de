"""DataFrameBench (CC-BY-4.0) tasks, read straight from the cached wheel's jsonl (never installed).

Invariant: ``train`` feeds product sessions (and so training); ``test`` is for evals only; ``val``
is never used by the team and is refused. The pandas condition is used: the stub imports
``pandas as pd`` and the reference is the pandas ground truth.
"""

from __future__ import annotations

import json
import zipfile
from functools import lru_cache

from app.core.errors import ConfigurationError
from evals.tasks.fetch import fetch_dataframebench
from evals.tasks.model import HIDDEN_RUNNER, Task, hidden_runner

SOURCE = "dataframebench"
SPLITS = ("train", "test")
TEST_FILE = "test_hidden.py"
# Some test files end with their own unittest.main() (which would exit first, also with 0 tests):
# it is disabled so the epilogue below runs the suite once.
_PRELUDE = (
    "import matplotlib\nmatplotlib.use('Agg')\n"
    "import unittest as _unittest_mod\n_unittest_mod.main = lambda *a, **k: None\n\n"
)
# unittest.main() would load tests from sys.modules['__main__'] (the runner file, not these exec'd
# globals) and pass with "Ran 0 tests"; collect the TestCases from globals and fail on zero tests.
_EPILOGUE = (
    "\n\nif __name__ == '__main__':\n    import sys as _sys, unittest as _unittest\n"
    "    _cases = [v for v in list(globals().values())\n"
    "              if isinstance(v, type) and issubclass(v, _unittest.TestCase)]\n"
    "    _suite = _unittest.TestSuite(_unittest.defaultTestLoader.loadTestsFromTestCase(c) for c in _cases)\n"
    "    _res = _unittest.TextTestRunner(verbosity=2).run(_suite)\n"
    "    _sys.exit(0 if _res.wasSuccessful() and _res.testsRun > 0 else 1)\n"
)


@lru_cache(maxsize=4)
def _records(split: str) -> tuple[dict, ...]:
    wheel = fetch_dataframebench()
    with zipfile.ZipFile(wheel) as z:
        lines = z.read(f"dataframebench/data/{split}.jsonl").decode("utf-8").splitlines()
    return tuple(json.loads(line) for line in lines if line.strip())


def _fill(text: str) -> str:
    return text.replace("{library_import}", "import pandas as pd").replace(
        "{library_instruction}", "Use pandas as the data processing library in your solution."
    )


def to_task(record: dict, split: str) -> Task:
    """One jsonl record -> ``Task`` (visible ``solution.py`` stub, hidden unittest suite)."""
    parts = record["prompt_parts"]
    stub = _fill(parts["stub"])
    entry = record.get("entry_point", "task_func")
    request = (
        f"Implement `{entry}` in solution.py. {parts['statement'].strip()}\n\n"
        "Use pandas as the data processing library."
    )
    return Task(
        id=record["task_id"],
        source=SOURCE,
        split=split,
        request=request,
        files={"solution.py": stub},
        test_command=f"python {HIDDEN_RUNNER}",
        test_files={TEST_FILE: record["test_code"], HIDDEN_RUNNER: hidden_runner(_PRELUDE, _EPILOGUE, TEST_FILE)},
        reference_files={"solution.py": record["ground_truth"]["pandas"]},
        metadata={
            "entry_point": entry,
            "category": record.get("category"),
            "libs": list(record.get("libs", [])),
            "seed_id": record.get("seed_id"),
            "library": "pandas",
        },
    )


def load(split: str) -> list[Task]:
    """Every task of ``split`` (``train`` or ``test``), in file order.

    Raises:
        ConfigurationError: ``val`` (never used) or an unknown split.
    """
    if split == "val":
        raise ConfigurationError("DataFrameBench's val split is never used by flywheel (train: sessions, test: evals)")
    if split not in SPLITS:
        raise ConfigurationError(f"unknown DataFrameBench split {split!r}; expected train or test")
    return [to_task(r, split) for r in _records(split)]

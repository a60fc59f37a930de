"""Task sources: one ``Task`` format (``evals.tasks.model``), adapters per source.

``load_tasks(source, split)`` is the only entry point the simulator and the eval runner use;
``verify_reference(task)`` proves a task is solvable in our sandbox (its reference passes).
"""

from __future__ import annotations

import random
import shutil
import tempfile
from pathlib import Path

from app.core.db import session_scope
from app.core.errors import ConfigurationError
from evals.harness.sandbox import SandboxLimits, SandboxResult, run_in_sandbox
from evals.harness.workspace import write_files
from evals.tasks import dataframebench, functions, functions_long, humaneval
from evals.tasks.mined import load_mined_tasks
from evals.tasks.model import Task

SOURCES = ("dataframebench", "humaneval", "functions", "functions_long", "mined")


def load_tasks(source: str, split: str, limit: int | None = None, seed: int = 0) -> list[Task]:
    """Tasks of ``source``/``split``; with ``limit``, a seeded random subset ordered by id.

    ``mined`` reads the ``eval_task`` table: the mined tasks with a verified environment
    (``evals.tasks.mined``; ``split`` is ignored; needs the database).

    Raises:
        ConfigurationError: unknown source or split (e.g. DataFrameBench ``val``).

    ``functions`` (generated function requests) has splits ``train``, ``test`` (held-out
    templates), ``test_params`` (unseen parameterisations of training templates) and ``fresh``
    (kinds of request no other split has);
    ``functions_long`` (multi-step requests in long files) has ``train`` and ``test``.
    """
    if source == "dataframebench":
        tasks = dataframebench.load(split)
    elif source == "humaneval":
        tasks = humaneval.load(split)
    elif source == "functions":
        tasks = functions.load(split)
    elif source == "functions_long":
        tasks = functions_long.load(split)
    elif source == "mined":
        with session_scope() as session:
            return load_mined_tasks(session, limit=limit, seed=seed)
    else:
        raise ConfigurationError(f"unknown task source {source!r}; expected one of {', '.join(SOURCES)}")
    if limit is not None and limit < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, limit), key=lambda t: t.id)
    return tasks


def verify_reference(task: Task, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run the task's hidden tests on its reference solution in the sandbox.

    Returns:
        The sandbox result (``.ok`` means the reference passes).
    """
    return _run_hidden(task, task.reference_files, limits)


def verify_stub(task: Task, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run the hidden tests on the untouched repository. ``.ok`` here means the task does not
    discriminate (a few DataFrameBench tasks pass with the bare stub): graders should know."""
    return _run_hidden(task, {}, limits)


def _run_hidden(task: Task, overlay: dict[str, str], limits: SandboxLimits | None) -> SandboxResult:
    work = Path(tempfile.mkdtemp(prefix="flywheel-ref-"))
    try:
        write_files(work, {**task.files, **overlay, **task.test_files})
        limits = limits or SandboxLimits(timeout_s=60)  # the standard library only: pass a suite's allow-list
        return run_in_sandbox(task.test_command, work, limits.with_packages(task.environment))
    finally:
        shutil.rmtree(work, ignore_errors=True)

"""A suite run's plan: which tasks, which (task, sample) pairs, and the effective suite version,
fixed before the first session.

Invariant: the plan's ``suite_version`` is the suite's fingerprint over its knobs and every task's
content hash, so a changed task or knob is a new version and results are never reused across it;
a (task, sample)'s sampling seed depends on neither the run nor the checkpoint, so the samples of
two checkpoints pair.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from app.core.errors import ConfigurationError
from evals.config import SuiteConfig
from evals.tasks import load_tasks

if TYPE_CHECKING:
    from evals.tasks.model import Task


@dataclass
class RunPlan:
    """What a run will execute: tasks, (task, sample) keys, and the effective suite version."""

    suite: SuiteConfig
    tasks: list["Task"]
    planned: list[tuple[str, int]]
    suite_version: str

    def config_json(self) -> dict[str, Any]:
        """The resolved plan as stored in ``eval_run.config``."""
        return {
            "suite": self.suite.model_dump(mode="json"),
            "planned": [list(k) for k in self.planned],
            "task_hashes": {t.id: task_hash(t) for t in self.tasks},
        }


def task_hash(task: "Task") -> str:
    """12 hex of sha256 over the task's full content (request, files, hidden tests)."""
    return hashlib.sha256(task.model_dump_json().encode()).hexdigest()[:12]


def load_suite_tasks(suite: SuiteConfig) -> list["Task"]:
    """The suite's tasks (``evals.tasks.load_tasks``: a source adapter's split, or the mined
    ``eval_task`` rows), a seeded subset when the suite has a limit."""
    return load_tasks(suite.source, suite.split, limit=suite.limit, seed=suite.seed)


def plan_run(suite: SuiteConfig, tasks: list["Task"] | None = None) -> RunPlan:
    """Fix the plan of a suite run (tasks loaded unless given)."""
    tasks = load_suite_tasks(suite) if tasks is None else tasks
    ids = [t.id for t in tasks]
    if len(set(ids)) != len(ids):
        raise ConfigurationError(f"suite {suite.name}: duplicate task ids")
    planned = [(t.id, s) for t in tasks for s in range(suite.samples_per_task)]
    version = suite.fingerprint([f"{t.id}:{task_hash(t)}" for t in tasks])
    return RunPlan(suite=suite, tasks=tasks, planned=planned, suite_version=version)


def sample_seed(suite: SuiteConfig, task_id: str, sample_index: int) -> int:
    """Sampling seed of one (task, sample): stable across runs and checkpoints, so samples pair."""
    digest = hashlib.sha256(f"{suite.seed}:{task_id}:{sample_index}".encode()).digest()
    return int.from_bytes(digest[:4], "big") & 0x7FFFFFFF

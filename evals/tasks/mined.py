"""The mined suite as a task source: the ``eval_task`` rows of suite ``mined`` (``evals.mined``
writes them) that have a verified environment.

Invariant: a row's ``spec`` is a ``Task`` dumped as JSON, so every mined task loads back unchanged.
"""

from __future__ import annotations

import random

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import EvalTask, TaskEnvironment
from evals.tasks.model import Task

MINED_SUITE = "mined"


def load_mined_tasks(
    session: Session, *, limit: int | None = None, seed: int = 0, verified_only: bool = True
) -> list[Task]:
    """The mined suite's tasks (a seeded subset of ``limit`` when given), ordered by id: by default
    only those with an environment verified for them (``task_environment``, set up by
    ``evals.mined_refresh`` or ``flywheel tasks setup-envs``), the ones the gate may hold a candidate to."""
    query = select(EvalTask).where(EvalTask.suite == MINED_SUITE)
    if verified_only:
        verified = select(TaskEnvironment.env_hash).where(
            TaskEnvironment.eval_task_id == EvalTask.task_id, TaskEnvironment.verified.is_(True)
        )
        query = query.where(verified.exists())
    rows = session.scalars(query.order_by(EvalTask.task_id)).all()
    tasks = [Task.model_validate(r.spec) for r in rows]
    if limit is not None and limit < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, limit), key=lambda t: t.id)
    return tasks

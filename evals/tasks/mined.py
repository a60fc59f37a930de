"""The mined suite as a task source: the ``eval_task`` rows of suite ``mined`` (``evals.mined``
writes them) that have a verified environment, each loaded to run in it.

Invariant: a row's ``spec`` is a ``Task`` dumped as JSON, so every mined task loads back unchanged.
"""

from __future__ import annotations

import random

from sqlalchemy import ColumnElement, case, select
from sqlalchemy.orm import Session

from app.models import EvalTask, TaskEnvironment
from evals.tasks.model import Task

MINED_SUITE = "mined"


def load_mined_tasks(
    session: Session, *, limit: int | None = None, seed: int = 0, verified_only: bool = True
) -> list[Task]:
    """The mined suite's tasks (a seeded subset of ``limit`` when given), ordered by id: by default
    only those with an environment verified for them (``task_environment``, set up by
    ``evals.mined_refresh`` or ``flywheel tasks setup-envs``), the ones the gate may hold a candidate to.
    Verified-only, each comes with its environment applied (:func:`with_environment`), so its sessions
    and its grading run in what verified it; with ``verified_only=False`` (setting environments up)
    the tasks come as mined."""
    query = select(EvalTask).where(EvalTask.suite == MINED_SUITE)
    if verified_only:
        verified = select(TaskEnvironment.env_hash).where(
            TaskEnvironment.eval_task_id == EvalTask.task_id, TaskEnvironment.verified.is_(True)
        )
        query = query.where(verified.exists())
    rows = session.scalars(query.order_by(EvalTask.task_id)).all()
    tasks = [Task.model_validate(r.spec) for r in rows]
    if verified_only:  # the tasks as the gate runs them; setting environments up needs them bare
        tasks = [
            with_environment(t, verified_environment(session, r.task_id)) for t, r in zip(tasks, rows, strict=True)
        ]
    if limit is not None and limit < len(tasks):
        tasks = sorted(random.Random(seed).sample(tasks, limit), key=lambda t: t.id)
    return tasks


def preferred_verified_environment(session: Session, *where: ColumnElement[bool]) -> TaskEnvironment | None:
    """The verified ``task_environment`` row matching ``where`` that is used: a model's before the
    resolver's fallback, the first stored of each, or None (also
    :func:`evals.environment_setup.cached_environment`'s order)."""
    return session.scalars(
        select(TaskEnvironment)
        .where(*where, TaskEnvironment.verified.is_(True))
        .order_by(case((TaskEnvironment.origin == "model", 0), else_=1), TaskEnvironment.created_at)
        .limit(1)
    ).first()


def verified_environment(session: Session, eval_task_id: str) -> TaskEnvironment | None:
    """The environment verified for the mined task ``eval_task_id`` (:func:`preferred_verified_environment`)."""
    return preferred_verified_environment(session, TaskEnvironment.eval_task_id == eval_task_id)


def with_environment(task: Task, environment: TaskEnvironment | None) -> Task:
    """``task`` to run in ``environment`` (its canonical ``{dependencies, files}`` proposal): the
    distributions as ``Task.environment``, the files added to the repository. Unchanged for None."""
    if environment is None:
        return task
    proposal = environment.proposal
    return task.model_copy(
        update={
            "environment": tuple(proposal.get("dependencies", ())),
            "files": {**task.files, **proposal.get("files", {})},
        }
    )

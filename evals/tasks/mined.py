"""The mined suite as a task source: the ``eval_task`` rows of suite ``mined`` (``evals.mined``
writes them) that have a verified environment, each loaded to run in it.

Invariant: a row's ``spec`` is a ``Task`` dumped as JSON, so every mined task loads back unchanged.
"""

from __future__ import annotations

import random
from datetime import datetime

from sqlalchemy import ColumnElement, case, select
from sqlalchemy.orm import InstrumentedAttribute, Session

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
    rows = list(session.scalars(query.order_by(EvalTask.task_id)).all())
    if limit is not None and limit < len(rows):
        rows = sorted(random.Random(seed).sample(rows, limit), key=lambda r: r.task_id)
    tasks = [Task.model_validate(r.spec) for r in rows]
    if not verified_only:  # setting environments up needs the tasks as mined
        return tasks
    environments = verified_environments(session, [r.task_id for r in rows])
    return [with_environment(t, environments.get(r.task_id)) for t, r in zip(tasks, rows, strict=True)]


def _preference() -> tuple[ColumnElement[int], InstrumentedAttribute[datetime]]:
    """The order in which verified environments are preferred: a model's before the resolver's
    fallback, then the first stored."""
    return case((TaskEnvironment.origin == "model", 0), else_=1), TaskEnvironment.created_at


def preferred_verified_environment(session: Session, *where: ColumnElement[bool]) -> TaskEnvironment | None:
    """The verified ``task_environment`` row matching ``where`` that is used: a model's before the
    resolver's fallback, the first stored of each, or None (also
    :func:`evals.environment_setup.cached_environment`'s order)."""
    return session.scalars(
        select(TaskEnvironment).where(*where, TaskEnvironment.verified.is_(True)).order_by(*_preference()).limit(1)
    ).first()


def verified_environments(session: Session, eval_task_ids: list[str]) -> dict[str, TaskEnvironment]:
    """The environment verified for each of the mined tasks ``eval_task_ids`` that has one, in one
    query: for each, the row :func:`preferred_verified_environment` gives for that task. Tasks
    without one are absent."""
    if not eval_task_ids:
        return {}
    rows = session.scalars(
        select(TaskEnvironment)
        .where(TaskEnvironment.eval_task_id.in_(eval_task_ids), TaskEnvironment.verified.is_(True))
        .order_by(TaskEnvironment.eval_task_id, *_preference())
    ).all()
    preferred: dict[str, TaskEnvironment] = {}
    for row in rows:  # the first of each task's rows is its preferred one
        if row.eval_task_id is not None:
            preferred.setdefault(row.eval_task_id, row)
    return preferred


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

"""The eval hold-out against training: a task is either held out (``eval_task``) or trained on, never both.

Two writers race on it. Mining (``evals.mined``) turns finalized trajectories into eval tasks and
checks that no registered checkpoint trained on them; a training cycle selects trajectories whose
task is not held out, trains for minutes to hours, then registers the candidate with its lineage
(``trainer.records``). Mining that runs while a cycle trains can hold out a task the cycle already
selected, and each side's check alone cannot see the other's uncommitted write (write skew). So
both take :attr:`AdvisoryLock.HOLDOUT` for their transaction, and registration retires the eval tasks its
candidate trained on (:func:`retire_trained_eval_tasks`): a gated suite must not score a candidate
on a task from its own training data. The task stays retired whichever way the candidate's gate
goes (one held-out task is cheap; a contaminated gate is not).
"""

from __future__ import annotations

from sqlalchemy import text
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock


def lock_holdout(session: Session) -> None:
    """Take :attr:`AdvisoryLock.HOLDOUT` until the session's transaction ends (waits for the holder)."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": AdvisoryLock.HOLDOUT})


def retire_trained_eval_tasks(session: Session, checkpoint_id: str) -> list[str]:
    """Delete the eval tasks that checkpoint ``checkpoint_id`` trained on: mined from one of its
    lineage's trajectories (``checkpoint_trajectory``, already written) or on a task id one of them
    worked on. Takes :attr:`AdvisoryLock.HOLDOUT` first, so a mining pass either commits before (and its
    tasks are retired here) or starts after and sees the lineage (``already_trained``).

    Returns:
        The retired task ids, sorted (empty when nothing was mined during the cycle).
    Raises:
        sqlalchemy.exc.DBAPIError: database faults (the caller's transaction rolls back).
    """
    lock_holdout(session)
    rows = session.execute(
        text(
            "DELETE FROM eval_task WHERE source_trajectory_id IN "
            "(SELECT trajectory_id FROM checkpoint_trajectory WHERE checkpoint_id = :cid) "
            "OR task_id IN (SELECT task_id FROM checkpoint_trajectory WHERE checkpoint_id = :cid "
            "AND task_id IS NOT NULL) RETURNING task_id"
        ),
        {"cid": checkpoint_id},
    ).scalars()
    return sorted(rows)

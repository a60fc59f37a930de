"""Task difficulty for the difficulty-aware length penalty: a trajectory's outcome, and for each
trajectory the outcomes of its task's earlier trajectories.

Invariant: a trajectory's :class:`TaskHistory` is a pure function of the stored finalized
trajectories: those of the same ``task_id`` finalized strictly before it (``finalized_at``, the
ingestion clock), itself excluded, each counted with the outcome its finalized ``signals`` show.
Finalized rows are pure functions of ``event_log`` and do not change (late signals never reach
them), so a history is the same on every relabel and after a replay, and does not move as later
trajectories arrive; only an erasure, which deletes trajectories, changes it.
"""

from __future__ import annotations

import uuid
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import Any


@dataclass(frozen=True)
class TaskHistory:
    """The outcomes of a task's trajectories finalized before one trajectory.

    Attributes:
        solved: sum of their outcomes (each in [0, 1], see :func:`trajectory_outcome`).
        attempts: how many had an outcome.
    """

    solved: float = 0.0
    attempts: int = 0


def trajectory_outcome(signals: dict[str, Any]) -> float | None:
    """How far a trajectory solved its task, in [0, 1], from its implicit signals (the ``signals``
    JSON of ``consumers.projection``); None when they show nothing. The most direct evidence wins:

    1. the developer's verdict: ``accepted / (accepted + rejected)`` edits, when any was decided;
    2. else the agent's last test run: 1.0 passed, 0.0 failed;
    3. else a dissatisfied follow-up: 0.0 (a complaint, nothing accepted);
    4. else None: the trajectory is not counted.
    """
    edits = (signals.get("edits") or {}).values()
    accepted = sum(1 for e in edits if e.get("decision") == "accepted")
    rejected = sum(1 for e in edits if e.get("decision") == "rejected")
    if accepted + rejected:
        return accepted / (accepted + rejected)
    passed = signals.get("last_test_passed")
    if passed is not None:
        return 1.0 if passed else 0.0
    if int(signals.get("dissatisfied_followups", 0)) > 0:
        return 0.0
    return None


def task_histories(
    rows: Iterable[tuple[uuid.UUID, str | None, datetime, float | None]],
) -> dict[uuid.UUID, TaskHistory]:
    """The :class:`TaskHistory` of every trajectory of ``rows`` that has a task.

    Args:
        rows: ``(trajectory id, task_id, finalized_at, outcome)`` of finalized trajectories, any order.
    Returns:
        id -> history of its task before it: trajectories finalized at the same instant do not see
        each other, and a trajectory without a task is absent (a reward then uses the prior alone).
        Outcomes are summed in ``(finalized_at, id)`` order, so the floats are the same every time.
    """
    by_task: dict[str, list[tuple[datetime, uuid.UUID, float | None]]] = defaultdict(list)
    for tid, task, at, outcome in rows:
        if task:
            by_task[task].append((at, tid, outcome))
    out: dict[uuid.UUID, TaskHistory] = {}
    for items in by_task.values():
        items.sort(key=lambda r: (r[0], r[1]))
        solved, attempts, i = 0.0, 0, 0
        while i < len(items):
            j = i
            while j < len(items) and items[j][0] == items[i][0]:
                j += 1
            tie = items[i:j]
            for _, tid, _ in tie:
                out[tid] = TaskHistory(solved, attempts)
            for _, _, outcome in tie:
                if outcome is not None:
                    solved, attempts = solved + outcome, attempts + 1
            i = j
    return out


def solve_rate(history: TaskHistory, prior_solved: float, prior_failed: float) -> float:
    """The posterior mean of the task's solve rate under a ``Beta(prior_solved, prior_failed)``
    prior: ``(solved + prior_solved) / (attempts + prior_solved + prior_failed)``; the prior's mean
    for a task never seen."""
    return (history.solved + prior_solved) / (history.attempts + prior_solved + prior_failed)

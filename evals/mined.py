"""Mining CursorBench-style eval tasks from production sessions, and keeping them out of training.

Invariants:
- A task is mined only from a *finalized* trajectory whose edits persisted (mean
  ``edit.persistence_measured`` fraction >= threshold) and whose session ran tests; its request is
  the session's first ``agent.requested`` text and its hidden test is the test the session ran
  (for simulated sessions on DataFrameBench/HumanEval tasks: the source task's test command and
  files, looked up by ``task_id``). Product sessions whose repository is not reconstructible are
  skipped with a reason, never guessed.
- Tasks are deduplicated by content hash and by source task id (``eval_task`` unique keys).
- A mined task goes when its source session does (an erasure or a privacy purge deletes it,
  ``consumers.erasure``).
- A mined task is held out for good: every trajectory on its ``task_id`` is marked
  ``reserved_for_eval`` (and the trainer skips task ids in ``eval_task``). A task some checkpoint
  already trained on is never mined (it would be contaminated from the start), and a candidate
  whose cycle selected its data before a task was mined retires that task when it registers
  (``app.repositories.holdout``: both sides hold its lock); :func:`find_contamination` re-checks
  every checkpoint's lineage and manifest.
"""

from __future__ import annotations

import hashlib
import json
import re
import uuid
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any, cast

from sqlalchemy import CursorResult, exists, select, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.models import Checkpoint, CheckpointTrajectory, EvalTask, EventLog, Trajectory
from app.repositories.holdout import lock_holdout
from evals.tasks import load_tasks
from evals.tasks.mined import MINED_SUITE
from evals.tasks.model import Task

#: Sources whose tasks can be rebuilt from ``task_id`` (splits searched, in order).
SOURCE_SPLITS = {
    "dataframebench": ("train", "test"),
    "humaneval": ("test",),
    "functions": ("train", "test", "test_params"),
}


@dataclass
class MiningReport:
    """What one mining pass did: tasks added and why the other trajectories were skipped."""

    examined: int = 0
    mined: list[str] = field(default_factory=list)
    skipped: Counter = field(default_factory=Counter)
    reserved_trajectories: int = 0


def content_hash(request: str, files: dict[str, str], test_command: str, test_files: dict[str, str]) -> str:
    """sha256 over the normalized request (whitespace collapsed, case folded) and the task's files and
    hidden test: two sessions asking the same thing of the same code are one task."""
    norm = re.sub(r"\s+", " ", request).strip().casefold()
    blob = json.dumps(
        {"request": norm, "files": files, "test_command": test_command, "test_files": test_files}, sort_keys=True
    )
    return hashlib.sha256(blob.encode()).hexdigest()


@lru_cache(maxsize=8)
def _source_index(source: str) -> dict[str, Task]:
    index: dict[str, Task] = {}
    for split in SOURCE_SPLITS[source]:
        for task in load_tasks(source, split):
            index.setdefault(task.id, task)
    return index


def source_task(source: str | None, task_id: str | None) -> "Task | None":
    """The DataFrameBench/HumanEval/functions task a simulated session worked on, or None (unknown source)."""
    if source not in SOURCE_SPLITS or not task_id:
        return None
    return _source_index(source).get(task_id)


def _session_facts(session: Session, session_id: str) -> dict[str, Any]:
    rows = session.execute(
        select(EventLog.type, EventLog.payload)
        .where(
            EventLog.session_id == session_id,
            EventLog.type.in_(("agent.requested", "tool.executed", "edit.persistence_measured")),
        )
        .order_by(EventLog.seq)
    ).all()
    request = next((p.get("text") for t, p in rows if t == "agent.requested"), None)
    fractions = [float(p["fraction_persisted"]) for t, p in rows if t == "edit.persistence_measured"]
    tests = [p.get("command") or "" for t, p in rows if t == "tool.executed" and p.get("ran_tests")]
    return {"request": request, "persistence": fractions, "test_commands": tests}


def _trained_task_ids(session: Session) -> set[str]:
    return set(session.scalars(select(CheckpointTrajectory.task_id).where(CheckpointTrajectory.task_id.is_not(None))))


def _still_there(session: Session, trajectory_id: uuid.UUID) -> bool:
    """Whether the trajectory still exists and is not being deleted, locking it ``FOR KEY SHARE`` (a
    deletion to come waits for us). One a deletion holds is skipped, not waited for (``SKIP
    LOCKED``): waiting could close a cycle with an erasure deleting several of the user's trajectories
    while this pass holds another of them. Ingest's updates take a lock this one does not conflict with."""
    return (
        session.execute(
            select(Trajectory.id)
            .where(Trajectory.id == trajectory_id)
            .with_for_update(read=True, key_share=True, skip_locked=True)
        ).first()
        is not None
    )


def mine_tasks(session: Session, *, min_persistence: float = 0.8, limit: int | None = None) -> MiningReport:
    """Turn qualifying finalized trajectories into held-out ``eval_task`` rows; flush.

    Args:
        min_persistence: mean fraction of accepted edits still present at measurement, in [0, 1].
        limit: most trajectories to examine in this pass (oldest finalized first).

    Returns:
        A :class:`MiningReport` (skip reasons: ``no_request``, ``no_persistence``,
        ``edits_not_persisted``, ``no_tests``, ``no_source_task``, ``already_trained``,
        ``duplicate``, ``erased``: deleted by an erasure or a privacy purge while the pass ran).
    Raises:
        sqlalchemy.exc.DBAPIError: database faults (the caller's transaction rolls back).

    Holds the eval hold-out lock for the caller's transaction (``app.repositories.holdout``), so a
    candidate registering meanwhile either sees these tasks (and retires any it trained on) or is
    seen here (``already_trained``). A trajectory to hold out is locked ``FOR KEY SHARE`` first: one an
    erasure deleted or is deleting is skipped (``erased``; if that erasure rolls back, the next pass
    mines it), one still to come waits and deletes the task too.
    """
    report = MiningReport()
    lock_holdout(session)
    trained_tasks = _trained_task_ids(session)
    stmt = (
        select(Trajectory)
        .where(Trajectory.status == "finalized", Trajectory.reserved_for_eval.is_(False))
        .order_by(Trajectory.finalized_at, Trajectory.id)
    )
    if limit:
        stmt = stmt.limit(limit)
    mined_task_ids: set[str] = set()
    for traj in session.scalars(stmt).all():
        report.examined += 1
        facts = _session_facts(session, traj.session_id)
        request = facts["request"] or traj.request_text
        skip, src = _skip_reason(session, traj, facts, request, trained_tasks, min_persistence)
        if skip is not None or src is None or request is None or traj.task_id is None:
            report.skipped[skip or "no_source_task"] += 1  # (_skip_reason skips a session with no request)
            continue
        if _insert_held_out(session, traj, _held_out_spec(src, traj, request, facts), request, src):
            report.mined.append(traj.task_id)
            mined_task_ids.add(traj.task_id)
        else:
            report.skipped["duplicate"] += 1
        # Either way the session itself is eval material now: never train on it.
        traj.reserved_for_eval = True
    if mined_task_ids:
        report.reserved_trajectories = _reserve_siblings(session, mined_task_ids)
    session.flush()
    return report


def _skip_reason(
    session: Session,
    traj: Trajectory,
    facts: dict[str, Any],
    request: str | None,
    trained_tasks: set[str],
    min_persistence: float,
) -> tuple[str | None, Task | None]:
    """Why ``traj`` is not held out (a :func:`mine_tasks` skip reason), else None, with its source
    task once found; checks cheapest first, the row lock (``erased``) last."""
    if not request:
        return "no_request", None
    if not facts["persistence"]:
        return "no_persistence", None
    if sum(facts["persistence"]) / len(facts["persistence"]) < min_persistence:
        return "edits_not_persisted", None
    if not (traj.ran_tests or facts["test_commands"]):
        return "no_tests", None
    src = source_task(traj.task_source, traj.task_id)
    if src is None:
        return "no_source_task", None
    if traj.task_id in trained_tasks or session.scalar(
        select(exists().where(CheckpointTrajectory.trajectory_id == traj.id))
    ):
        return "already_trained", src
    if not _still_there(session, traj.id):
        return "erased", src
    return None, src


def _held_out_spec(src: Task, traj: Trajectory, request: str, facts: dict[str, Any]) -> Task:
    """The mined task: the source task under the trajectory's task id, with the developer's request
    and where it came from in its metadata."""
    return src.model_copy(
        update={
            "id": traj.task_id,
            "source": MINED_SUITE,
            "split": "test",
            "request": request,
            "reference_files": dict(src.reference_files),
            "metadata": {
                **src.metadata,
                "source_task_id": src.id,
                "source": traj.task_source,
                "session_id": traj.session_id,
                "trajectory_id": str(traj.id),
                "persistence": facts["persistence"],
                "tests_ran": facts["test_commands"] or traj.test_commands,
            },
        }
    )


def _insert_held_out(session: Session, traj: Trajectory, spec: Task, request: str, src: Task) -> bool:
    """Insert the ``eval_task`` row; False when the task id is held out already."""
    inserted = session.execute(
        insert(EvalTask)
        .values(
            task_id=traj.task_id,
            suite=MINED_SUITE,
            source_session_id=traj.session_id,
            source_trajectory_id=traj.id,
            content_hash=content_hash(request, src.files, src.test_command, src.test_files),
            spec=spec.model_dump(mode="json"),
        )
        .on_conflict_do_nothing()
        .returning(EvalTask.task_id)
    ).first()
    return inserted is not None


def _reserve_siblings(session: Session, task_ids: set[str]) -> int:
    """Reserve every other trajectory on a mined task for evals; returns how many. Those being
    deleted are skipped, as above; the trainer also leaves out any trajectory whose task is in
    ``eval_task``."""
    siblings = (
        select(Trajectory.id)
        .where(Trajectory.task_id.in_(task_ids), Trajectory.reserved_for_eval.is_(False))
        .with_for_update(read=True, key_share=True, skip_locked=True)
    )
    result = cast(  # an UPDATE's result is a CursorResult, which has rowcount
        CursorResult[Any],
        session.execute(
            update(Trajectory)
            .where(Trajectory.id.in_(siblings))
            .values(reserved_for_eval=True)
            .execution_options(synchronize_session=False)
        ),
    )
    return result.rowcount


@dataclass(frozen=True)
class Contamination:
    """An eval task found in what a checkpoint trained on."""

    checkpoint_id: str
    task_id: str
    via: str  # checkpoint_trajectory.task_id | checkpoint_trajectory.trajectory_id | manifest


def _manifest_ids(obj: Any, tasks: set[str], trajs: set[str]) -> None:
    """Collect every task id and trajectory id a manifest names, whatever its nesting."""
    if isinstance(obj, dict):
        for k, v in obj.items():
            if k in ("task_id", "task_ids"):
                tasks.update([v] if isinstance(v, str) else [x for x in v or () if isinstance(x, str)])
            elif k in ("trajectory_id", "trajectory_ids"):
                trajs.update([str(v)] if isinstance(v, str) else [str(x) for x in v or ()])
            elif k == "trajectories" and isinstance(v, list):
                trajs.update(str(x) for x in v if isinstance(x, str))
            _manifest_ids(v, tasks, trajs)
    elif isinstance(obj, list):
        for v in obj:
            _manifest_ids(v, tasks, trajs)


def find_contamination(session: Session, extra_task_ids: Iterable[str] = ()) -> list[Contamination]:
    """Every (checkpoint, eval task) pair where the checkpoint trained on the task.

    Checks ``eval_task`` (plus ``extra_task_ids``, e.g. the static suites' task ids) against each
    checkpoint's ``checkpoint_trajectory`` rows (task id and source trajectory id) and against the ids
    its stored manifest names.
    """
    held = {r.task_id: r.source_trajectory_id for r in session.scalars(select(EvalTask))}
    eval_ids = set(held) | set(extra_task_ids)
    by_traj = {str(t): task for task, t in held.items() if t is not None}
    found: set[Contamination] = set()
    if eval_ids:
        for ckpt, task in session.execute(
            select(CheckpointTrajectory.checkpoint_id, CheckpointTrajectory.task_id).where(
                CheckpointTrajectory.task_id.in_(eval_ids)
            )
        ):
            if task is not None:  # always: selected by task_id
                found.add(Contamination(ckpt, task, "checkpoint_trajectory.task_id"))
    if by_traj:
        ids = [uuid.UUID(t) for t in by_traj]
        for ckpt, traj in session.execute(
            select(CheckpointTrajectory.checkpoint_id, CheckpointTrajectory.trajectory_id).where(
                CheckpointTrajectory.trajectory_id.in_(ids)
            )
        ):
            found.add(Contamination(ckpt, by_traj[str(traj)], "checkpoint_trajectory.trajectory_id"))
    for ckpt_id, manifest in session.execute(select(Checkpoint.id, Checkpoint.manifest)):
        tasks: set[str] = set()
        trajs: set[str] = set()
        _manifest_ids(manifest or {}, tasks, trajs)
        for task in tasks & eval_ids:
            found.add(Contamination(ckpt_id, task, "manifest"))
        for traj_id in trajs & set(by_traj):
            found.add(Contamination(ckpt_id, by_traj[traj_id], "manifest"))
    return sorted(found, key=lambda c: (c.checkpoint_id, c.task_id, c.via))

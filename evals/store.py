"""DB access for eval runs, their shards, per-task results and gate decisions (flush, never commit).

Invariants: at most one ``running`` eval_run per (checkpoint, suite, suite version) is resumed
(:func:`find_run`; ``stopped`` marks a run that its gate's confidence sequence ended early,
resumed like ``running`` and ``failed`` by a later run of the plan); a result is written once per (run, task, sample) (``ON CONFLICT DO NOTHING``), so
a resumed or duplicated worker cannot double-count; a shard is claimed by one worker at a time
(``pending`` -> ``running`` under a row lock, ``attempts`` bumped as the claim's fencing token);
a gate decision, the checkpoint's new status and its ``gate.decided`` outbox row are written by
``app.lifecycle.gating`` in one transaction (this module only reads them).
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import func, select, text, update
from sqlalchemy.dialects.postgresql import insert
from sqlalchemy.orm import Session

from app.core.db import get_engine
from app.core.errors import ConflictError
from app.core.locks import named_lock_key
from app.models import Checkpoint, EvalResult, EvalRun, EvalShard, GateDecision
from app.models.checkpoints import CheckpointStatus
from evals.gate.models import Outcome, SuiteOutcomes

RESULT_FIELDS = (
    "passed",
    "attempts",
    "turns",
    "completion_tokens",
    "latency_s",
    "tool_calls",
    "tool_call_errors",
    "asked_question",
    "edited",
    "error",
    "detail",
)


def find_run(session: Session, checkpoint_id: str, suite: str, suite_version: str, *, status: str) -> EvalRun | None:
    """The newest run of this checkpoint on this exact suite version with ``status``."""
    return session.scalars(
        select(EvalRun)
        .where(
            EvalRun.checkpoint_id == checkpoint_id,
            EvalRun.suite == suite,
            EvalRun.suite_version == suite_version,
            EvalRun.status == status,
        )
        .order_by(EvalRun.started_at.desc())
        .limit(1)
    ).first()


def succeeded_runs(session: Session, checkpoint_id: str, suite: str) -> list[EvalRun]:
    """Every ``succeeded`` run of this checkpoint on this suite (any version), newest first."""
    return list(
        session.scalars(
            select(EvalRun)
            .where(EvalRun.checkpoint_id == checkpoint_id, EvalRun.suite == suite, EvalRun.status == "succeeded")
            .order_by(EvalRun.finished_at.desc().nulls_last(), EvalRun.started_at.desc())
        )
    )


def create_run(session: Session, checkpoint_id: str, suite: str, suite_version: str, config: dict[str, Any]) -> EvalRun:
    """Insert a ``running`` eval_run; flush."""
    run = EvalRun(
        id=uuid.uuid4(),
        checkpoint_id=checkpoint_id,
        suite=suite,
        suite_version=suite_version,
        status="running",
        config=config,
        summary={},
    )
    session.add(run)
    session.flush()
    return run


def done_keys(session: Session, run_id: uuid.UUID) -> set[tuple[str, int]]:
    """(task_id, sample_index) of every result already stored for the run."""
    rows = session.execute(select(EvalResult.task_id, EvalResult.sample_index).where(EvalResult.run_id == run_id))
    return {(t, i) for t, i in rows}


def add_result(session: Session, run_id: uuid.UUID, task_id: str, sample_index: int, **fields: Any) -> bool:
    """Store one sample's outcome unless already present. Returns whether a row was inserted."""
    values = {k: v for k, v in fields.items() if k in RESULT_FIELDS}
    values.setdefault("detail", {})
    stmt = (
        insert(EvalResult)
        .values(run_id=run_id, task_id=task_id, sample_index=sample_index, **values)
        .on_conflict_do_nothing(index_elements=["run_id", "task_id", "sample_index"])
        .returning(EvalResult.id)
    )
    return session.execute(stmt).first() is not None


def results(session: Session, run_id: uuid.UUID) -> list[EvalResult]:
    """Every result of a run, ordered by task and sample."""
    return list(
        session.scalars(
            select(EvalResult).where(EvalResult.run_id == run_id).order_by(EvalResult.task_id, EvalResult.sample_index)
        )
    )


def finish_run(session: Session, run: EvalRun, status: str, summary: dict[str, Any]) -> None:
    """Close a run (``succeeded`` or ``failed``) with its summary; flush."""
    run.status = status
    run.summary = summary
    run.finished_at = datetime.now(UTC)
    session.flush()


def outcomes(session: Session, run: EvalRun) -> SuiteOutcomes:
    """A run's results as the gate's input; ``planned`` comes from the run's stored plan."""
    planned = [(t, int(i)) for t, i in run.config.get("planned", [])]
    outs = [
        Outcome(
            task_id=r.task_id,
            sample_index=r.sample_index,
            passed=r.passed,
            completion_tokens=r.completion_tokens,
            latency_s=r.latency_s,
            tool_calls=r.tool_calls,
            tool_call_errors=r.tool_call_errors,
            asked_question=r.asked_question,
            edited=r.edited,
            error=r.error,
            sandbox_denials=int((r.detail or {}).get("sandbox_denials", 0)),
        )
        for r in results(session, run.id)
    ]
    return SuiteOutcomes(
        suite=run.suite,
        suite_version=run.suite_version,
        outcomes=outs,
        planned=planned,
        run_id=str(run.id),
        checkpoint_id=run.checkpoint_id,
        stopped=run.status == "stopped",
    )


@contextmanager
def advisory_lock(*parts: str) -> Iterator[None]:
    """Hold a Postgres session-level advisory lock named by ``parts`` for the block.

    The lock lives on its own autocommit connection (no transaction stays open while an eval runs for
    minutes), so two processes (a CLI and a Celery worker) never run the same eval or gate at once;
    the lock dies with the process if it is killed.

    Raises:
        ConflictError: another process holds it.
    """
    key = named_lock_key(*parts)
    with get_engine().connect().execution_options(isolation_level="AUTOCOMMIT") as conn:
        if not conn.execute(text("SELECT pg_try_advisory_lock(:k)"), {"k": key}).scalar():
            raise ConflictError(f"{'/'.join(parts)} is already running in another process")
        try:
            yield
        finally:
            conn.execute(text("SELECT pg_advisory_unlock(:k)"), {"k": key})


def candidates_without_decision(session: Session, limit: int = 10) -> list[str]:
    """STABLE ``candidate`` checkpoints that no gate decision mentions yet, oldest first."""
    decided = select(GateDecision.candidate_id)
    stmt = (
        select(Checkpoint.id)
        .where(
            Checkpoint.status == CheckpointStatus.CANDIDATE, Checkpoint.stable.is_(True), Checkpoint.id.not_in(decided)
        )
        .order_by(Checkpoint.created_at, Checkpoint.id)
        .limit(limit)
    )
    return list(session.scalars(stmt))


def latest_decision(session: Session, candidate_id: str) -> GateDecision | None:
    """The newest gate decision on a candidate."""
    return session.scalars(
        select(GateDecision)
        .where(GateDecision.candidate_id == candidate_id)
        .order_by(GateDecision.created_at.desc())
        .limit(1)
    ).first()


def run_counts(session: Session, run_id: uuid.UUID) -> tuple[int, int]:
    """(results stored, results passed) of a run."""
    n, k = session.execute(
        select(func.count(), func.count().filter(EvalResult.passed)).where(EvalResult.run_id == run_id)
    ).one()
    return int(n), int(k)


# ---- shards ---------------------------------------------------------------------------------------


def create_shards(session: Session, run_id: uuid.UUID, shards: list[list[dict[str, Any]]]) -> None:
    """Insert shard ``i`` holding the serialized tasks ``shards[i]`` (``pending``); existing rows are
    kept as they are (``ON CONFLICT DO NOTHING``); flush."""
    for index, tasks in enumerate(shards):
        stmt = (
            insert(EvalShard)
            .values(run_id=run_id, shard_index=index, tasks=tasks, status="pending", attempts=0, errors=[])
            .on_conflict_do_nothing(index_elements=["run_id", "shard_index"])
        )
        session.execute(stmt)
    session.flush()


def shards(session: Session, run_id: uuid.UUID) -> list[EvalShard]:
    """Every shard of a run, by index."""
    return list(session.scalars(select(EvalShard).where(EvalShard.run_id == run_id).order_by(EvalShard.shard_index)))


def reset_failed_shards(session: Session, run_id: uuid.UUID) -> list[int]:
    """Put the run's ``failed`` shards back to ``pending`` (a rerun retries them); their indexes."""
    rows = session.execute(
        update(EvalShard)
        .where(EvalShard.run_id == run_id, EvalShard.status == "failed")
        .values(status="pending")
        .returning(EvalShard.shard_index)
    )
    return sorted(i for (i,) in rows)


def mark_dispatched(session: Session, run_id: uuid.UUID, indexes: list[int]) -> None:
    """Stamp ``dispatched_at`` (database time) on the given shards."""
    if indexes:
        session.execute(
            update(EvalShard)
            .where(EvalShard.run_id == run_id, EvalShard.shard_index.in_(indexes))
            .values(dispatched_at=func.now())
        )


def claim_shard(session: Session, run_id: uuid.UUID, worker: str, index: int | None = None) -> EvalShard | None:
    """Claim a ``pending`` shard for ``worker``: shard ``index``, or any (highest index first).

    The claimed row becomes ``running`` with ``attempts`` + 1 (the claim's fencing token) and fresh
    ``claimed_at``/``heartbeat_at`` (database time). Rows locked by a concurrent claim are skipped.

    Returns:
        The claimed shard, or None when no such shard is pending.
    """
    stmt = select(EvalShard).where(EvalShard.run_id == run_id, EvalShard.status == "pending")
    if index is not None:
        stmt = stmt.where(EvalShard.shard_index == index)
    shard = session.scalars(
        stmt.order_by(EvalShard.shard_index.desc()).limit(1).with_for_update(skip_locked=True)
    ).first()
    if shard is None:
        return None
    shard.status = "running"
    shard.attempts += 1
    shard.worker = worker[:256]
    shard.claimed_at = shard.heartbeat_at = func.now()
    session.flush()
    session.refresh(shard)
    return shard


def heartbeat_shard(session: Session, run_id: uuid.UUID, index: int, attempt: int) -> bool:
    """Refresh the heartbeat of claim ``attempt``; False when the shard is no longer that claim's."""
    row = session.execute(
        update(EvalShard)
        .where(
            EvalShard.run_id == run_id,
            EvalShard.shard_index == index,
            EvalShard.attempts == attempt,
            EvalShard.status == "running",
        )
        .values(heartbeat_at=func.now())
        .returning(EvalShard.shard_index)
    ).first()
    return row is not None


def finish_shard(session: Session, run_id: uuid.UUID, index: int, attempt: int, errors: list[str]) -> bool:
    """Close claim ``attempt``: ``done`` without errors, else ``failed`` with them appended.

    Returns:
        False (and changes nothing) when the shard is no longer that claim's.
    """
    shard = session.scalars(
        select(EvalShard)
        .where(EvalShard.run_id == run_id, EvalShard.shard_index == index, EvalShard.attempts == attempt)
        .with_for_update()
    ).first()
    if shard is None or shard.status != "running":
        return False
    shard.status = "failed" if errors else "done"
    shard.errors = [*shard.errors, *errors]
    shard.finished_at = func.now()
    session.flush()
    return True


def stale_shards(session: Session, run_id: uuid.UUID, timeout_s: float) -> list[EvalShard]:
    """``running`` shards of the run whose heartbeat is older than ``timeout_s`` seconds (database
    time), locked for update; rows locked elsewhere are skipped."""
    cutoff = func.now() - func.make_interval(0, 0, 0, 0, 0, 0, timeout_s)
    return list(
        session.scalars(
            select(EvalShard)
            .where(EvalShard.run_id == run_id, EvalShard.status == "running", EvalShard.heartbeat_at < cutoff)
            .order_by(EvalShard.shard_index)
            .with_for_update(skip_locked=True)
        )
    )


def release_shard(session: Session, shard: EvalShard, note: str, *, failed: bool) -> None:
    """End a lost claim: the shard goes back to ``pending`` (or to ``failed``) with ``note`` appended
    to its errors; ``attempts`` stays, so the lost claimant is fenced out. Flush."""
    shard.status = "failed" if failed else "pending"
    shard.errors = [*shard.errors, note]
    if failed:
        shard.finished_at = func.now()
    session.flush()

"""Eval runs split into shards that Celery workers claim, so a bigger suite takes more workers.

The process that holds an eval run (:func:`evals.runner.run_suite`, with
``execute=ShardedExecution(...)``) is the run's coordinator: it splits the plan's tasks into shards,
dispatches one message per shard (``flywheel.evals.run_shard``), works through pending shards
itself, re-queues shards whose worker was lost, and returns once every shard is ``done`` or
``failed``. ``run_suite`` then computes the run's summary from the stored results, exactly as for an
unsharded run, so pass rates and intervals do not depend on the sharding.

Invariants:
- A shard is keyed by (eval run, shard index). Its tasks are fixed when the run is first sharded and
  stored in its row, so any worker can run it from the row alone. Running a shard runs only its
  (task, sample) pairs with no stored result, and a result is written once per (run, task, sample),
  so a shard run twice (a redelivered message, a retry after a lost worker) stores the same results.
- One claimant at a time: a claim moves ``pending`` -> ``running`` and bumps ``attempts``, the
  claim's fencing token; only the current claimant heartbeats or finishes the shard, and one that
  finds itself superseded stops after its samples in flight.
- A lost worker's shard is retried: the coordinator puts a ``running`` shard whose heartbeat is older
  than ``timeout_s`` back to ``pending`` and dispatches it again; after ``max_attempts`` lost claims
  in one coordination it is ``failed`` (a rerun of the run retries failed shards). This does not rely
  on the broker redelivering the message: kombu's SQL transport never redelivers a message taken by
  a killed worker, and Redis only after its visibility timeout (an hour by default).
- The coordinator claims pending shards too (highest index first, while workers take the dispatched
  messages lowest first), so a run completes with no other worker, a lost message only delays its
  shard, and a coordinator that holds a worker slot never waits on that slot. It reaps lost shards
  between the shards it runs itself.
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from types import TracebackType
from typing import TYPE_CHECKING, Any

from app.core.db import session_scope
from app.core.errors import ConfigurationError
from app.models import EvalRun, EvalShard
from evals import store
from evals.config import SuiteConfig
from evals.plan import RunPlan, task_hash
from evals.runner import ResultCallback, eval_engine, execute_samples
from evals.tasks.model import Task

if TYPE_CHECKING:
    from app.inference.engine import InferenceEngine

ShardDispatch = Callable[[str, int], Any]
"""Enqueues ``(run_id, shard_index)`` for a worker (``flywheel.evals.run_shard``)."""


def layout(tasks: list[Task], shards: int) -> list[list[Task]]:
    """Split ``tasks`` into at most ``shards`` contiguous slices in plan order, sizes differing by at
    most one (no empty slice).

    Raises:
        ValueError: ``shards`` < 1.
    """
    if shards < 1:
        raise ValueError(f"shards must be >= 1, got {shards}")
    n = min(shards, len(tasks))
    size, extra = divmod(len(tasks), n) if n else (0, 0)
    out, start = [], 0
    for i in range(n):
        end = start + size + (1 if i < extra else 0)
        out.append(tasks[start:end])
        start = end
    return out


def worker_name() -> str:
    """``host:pid`` of this process, the claimant name of a process that is no Celery worker."""
    return f"{socket.gethostname()}:{os.getpid()}"


@dataclass(frozen=True)
class ShardClaim:
    """A claimed shard: which one, the claim's fencing token (``attempt``), and its tasks."""

    run_id: uuid.UUID
    index: int
    attempt: int
    worker: str
    tasks: list[dict[str, Any]]

    @classmethod
    def of(cls, row: EvalShard) -> ShardClaim:
        """The claim a just-claimed row stands for."""
        return cls(row.run_id, row.shard_index, row.attempts, row.worker or "", list(row.tasks))


@dataclass
class ShardOutcome:
    """What running a claimed shard did. ``status``: ``done`` | ``failed`` (sample errors) |
    ``superseded`` (the claim was taken over; nothing closed)."""

    run_id: str
    shard: int
    attempt: int
    worker: str
    status: str
    ran: int = 0
    errors: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


class ShardSuperseded(Exception):
    """The claim being run is no longer the shard's current one."""


class Heartbeat:
    """Refreshes a claim's ``heartbeat_at`` every ``interval_s`` seconds from a daemon thread while
    the block runs; :attr:`superseded` is set once the shard is no longer this claim's."""

    def __init__(self, claim: ShardClaim, interval_s: float) -> None:
        self.claim = claim
        self.interval_s = interval_s
        self.superseded = threading.Event()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._beat, name=f"shard-heartbeat-{claim.index}", daemon=True)

    def _beat(self) -> None:
        c = self.claim
        while not self._stop.wait(self.interval_s):
            with session_scope() as session:
                if not store.heartbeat_shard(session, c.run_id, c.index, c.attempt):
                    self.superseded.set()
                    return

    def __enter__(self) -> Heartbeat:
        self._thread.start()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._stop.set()
        self._thread.join()


def run_claimed(
    claim: ShardClaim,
    *,
    workers: int | None,
    engine: "InferenceEngine | None",
    heartbeat_s: float,
    on_result: ResultCallback | None = None,
) -> ShardOutcome:
    """Run a claimed shard's samples that have no stored result, heartbeating, then close the claim.

    Args:
        claim: from :func:`evals.store.claim_shard`.
        workers: concurrent sessions (None: the engine's default, :func:`evals.runner.default_workers`).
        engine: an engine serving the run's checkpoint; None: one built for the shard and closed.
        heartbeat_s: seconds between heartbeats (well under the coordinator's ``timeout_s``).
        on_result: called after each stored result ``(task_id, sample, fields)``.

    Returns:
        The :class:`ShardOutcome`; a sample whose session raised is not stored and fails the shard.

    Raises:
        ConfigurationError: a stored task no longer hashes to the run's plan.
        Whatever building the engine raises; the claim is then left to the coordinator's reaper.
    """
    with session_scope() as session:
        run = session.get_one(EvalRun, claim.run_id)
        suite = SuiteConfig.model_validate(run.config["suite"])
        hashes = run.config.get("task_hashes", {})
        checkpoint_id, version = run.checkpoint_id, run.suite_version
        done = store.done_keys(session, claim.run_id)
    tasks = [Task.model_validate(t) for t in claim.tasks]
    for task in tasks:
        if hashes.get(task.id) != task_hash(task):
            raise ConfigurationError(
                f"shard {claim.index} of run {claim.run_id}: task {task.id} is not the planned one"
            )
    planned = [(t.id, k) for t in tasks for k in range(suite.samples_per_task)]
    plan = RunPlan(suite=suite, tasks=tasks, planned=planned, suite_version=version)
    todo = [(t, k) for t in tasks for k in range(suite.samples_per_task) if (t.id, k) not in done]
    outcome = ShardOutcome(str(claim.run_id), claim.index, claim.attempt, claim.worker, "superseded", ran=len(todo))
    with Heartbeat(claim, heartbeat_s) as beat:

        def stored(task_id: str, sample: int, fields: dict[str, Any]) -> None:
            if on_result is not None:
                on_result(task_id, sample, fields)
            if beat.superseded.is_set():
                raise ShardSuperseded(f"shard {claim.index} attempt {claim.attempt}")

        try:
            outcome.errors = execute_samples(claim.run_id, plan, todo, checkpoint_id, workers, engine, stored)
        except ShardSuperseded:
            return outcome
    with session_scope() as session:
        if store.finish_shard(session, claim.run_id, claim.index, claim.attempt, outcome.errors):
            outcome.status = "failed" if outcome.errors else "done"
    return outcome


def take_shard(
    run_id: str, shard_index: int, *, worker: str, workers: int | None, heartbeat_s: float
) -> dict[str, Any]:
    """Claim shard ``shard_index`` of ``run_id`` and run it (the body of ``flywheel.evals.run_shard``).

    Returns:
        :meth:`ShardOutcome.as_dict`, or ``{"run_id", "shard", "skipped": status}`` when the shard is
        not pending (done, failed, claimed by another worker, or unknown).
    """
    rid = uuid.UUID(run_id)
    with session_scope() as session:
        row = store.claim_shard(session, rid, worker, index=shard_index)
        claim = ShardClaim.of(row) if row is not None else None
        if claim is None:
            current = session.get(EvalShard, (rid, shard_index))
            return {"run_id": run_id, "shard": shard_index, "skipped": current.status if current else "unknown"}
    return run_claimed(claim, workers=workers, engine=None, heartbeat_s=heartbeat_s).as_dict()


@dataclass
class ShardedExecution:
    """A :data:`evals.runner.SampleExecutor` that runs an eval run as shards on Celery workers.

    Attributes:
        shards: how many shards the run's tasks are split into (at most one per task); fixed for the
            run when it is first sharded (a resumed run keeps its layout).
        dispatch: enqueues a shard for a worker (``flywheel.evals.run_shard``).
        timeout_s: a ``running`` shard whose heartbeat is older than this is presumed lost.
        max_attempts: lost claims per shard in one coordination before it is ``failed``.
        heartbeat_s: heartbeat interval of the shards this process runs itself.
        poll_s: seconds between looks at the shard table while other workers run them.
    """

    shards: int
    dispatch: ShardDispatch
    timeout_s: float = 60.0
    max_attempts: int = 3
    heartbeat_s: float = 10.0
    poll_s: float = 0.5
    worker: str = field(default_factory=worker_name)

    def __call__(
        self,
        run_id: uuid.UUID,
        plan: RunPlan,
        todo: list[tuple[Task, int]],
        checkpoint_id: str,
        workers: int | None,
        engine: "InferenceEngine | None",
        on_result: ResultCallback | None,
    ) -> list[str]:
        """Shard the run (once), dispatch its pending shards, run shards here until none is open.

        Returns:
            The errors recorded on shards that ended ``failed`` (sample errors, lost claims).
        """
        if not todo:
            return []
        with session_scope() as session:
            if not store.shards(session, run_id):
                slices = layout(plan.tasks, self.shards)
                store.create_shards(session, run_id, [[t.model_dump(mode="json") for t in s] for s in slices])
            store.reset_failed_shards(session, run_id)
            pending = [s.shard_index for s in store.shards(session, run_id) if s.status == "pending"]
            store.mark_dispatched(session, run_id, pending)
        for index in pending:
            self.dispatch(str(run_id), index)
        lost: dict[int, int] = {}
        own_engine = None
        try:
            while True:
                self._reap(run_id, lost)
                with session_scope() as session:
                    row = store.claim_shard(session, run_id, self.worker)
                    claim = ShardClaim.of(row) if row is not None else None
                    open_ = claim is not None or any(
                        s.status in ("pending", "running") for s in store.shards(session, run_id)
                    )
                if claim is not None:
                    if engine is None and own_engine is None:
                        own_engine = eval_engine(checkpoint_id)
                    run_claimed(
                        claim,
                        workers=workers,
                        engine=engine or own_engine,
                        heartbeat_s=self.heartbeat_s,
                        on_result=on_result,
                    )
                elif not open_:
                    break
                else:
                    time.sleep(self.poll_s)
        finally:
            if own_engine is not None:
                own_engine.close()
        with session_scope() as session:
            return [str(e) for s in store.shards(session, run_id) if s.status == "failed" for e in s.errors]

    def _reap(self, run_id: uuid.UUID, lost: dict[int, int]) -> None:
        """Re-queue (and dispatch again) shards whose claimant stopped heartbeating."""
        requeued = []
        with session_scope() as session:
            for shard in store.stale_shards(session, run_id, self.timeout_s):
                lost[shard.shard_index] = lost.get(shard.shard_index, 0) + 1
                failed = lost[shard.shard_index] >= self.max_attempts
                note = f"attempt {shard.attempts} lost: {shard.worker} sent no heartbeat for {self.timeout_s:g} s" + (
                    f"; failed after {self.max_attempts} lost attempts" if failed else ""
                )
                store.release_shard(session, shard, note, failed=failed)
                if not failed:
                    requeued.append(shard.shard_index)
            store.mark_dispatched(session, run_id, requeued)
        for index in requeued:
            self.dispatch(str(run_id), index)

"""Relabel: recompute reward labels of finalized trajectories under a spec, from ``event_log``.

Invariant: a relabel reads only ``event_log`` and its archive (never Kafka; archived days through
``consumers.archive.iter_stored_rows``) and folds EVERY stored event of each
session, late signals included (the live label ignored signals that arrived after finalization;
a relabel is where they count). It writes ``reward_label`` rows for one spec in one transaction,
so readers see the old labels or the new ones, never a mix, and reports how the distribution moved.
While it scans, the new labels wait in a temporary table and no trajectory is locked: the group's
erasures are not held up (an erasure holds up every ingest batch while it waits), and a trajectory
erased meanwhile gets no label and counts nowhere in the report's ``after``, ``relabeled``, ``changed``.

A spec that weighs length by the task's difficulty (``RewardSpec.needs_task_history``) also reads
each trajectory's task history (``consumers.rewards.difficulty``) from the stored trajectories. It
first waits for the ingest batches and sweeps in flight to commit (:func:`settle_finalizations`,
which holds up ingest for about one batch), so every trajectory finalized before a labelled one is
stored by then and the labels are a function of ``event_log`` alone.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import psycopg

from app.core.db import session_scope
from app.core.locks import AdvisoryLock
from app.repositories import trajectories as trepo
from app.repositories.events import raw_connection
from consumers.archive import iter_stored_rows
from consumers.projection import ProjectionConfig, Projector
from consumers.replay import stored_event_from_row
from consumers.rewards.difficulty import TaskHistory, task_histories, trajectory_outcome
from consumers.rewards.math import RewardResult
from consumers.rewards.spec import RewardSpec, active_specs, load_spec
from consumers.trajectory_state import TrajectoryState, new_trajectory


def distribution(values: list[float]) -> dict[str, float | None]:
    """n, mean, std, min, p10, p25, p50, p75, p90, max of ``values`` (None, JSON ``null``, when
    empty: no labels under the spec)."""
    if not values:
        return {"n": 0, **{k: None for k in ("mean", "std", "min", "p10", "p25", "p50", "p75", "p90", "max")}}
    a = np.asarray(values, dtype=np.float64)
    q = np.quantile(a, [0.1, 0.25, 0.5, 0.75, 0.9])
    return {
        "n": int(a.size),
        "mean": float(a.mean()),
        "std": float(a.std()),
        "min": float(a.min()),
        "p10": float(q[0]),
        "p25": float(q[1]),
        "p50": float(q[2]),
        "p75": float(q[3]),
        "p90": float(q[4]),
        "max": float(a.max()),
    }


def settle_finalizations() -> None:
    """Return once every ingest batch and window sweep in flight has committed: the projection lock
    is taken exclusively in a transaction of its own and released at its commit (new batches wait
    that long). Afterwards every trajectory finalized before this call is stored, as finalized or as
    provisional with its window closed.

    Raises:
        psycopg.Error: database faults.
    """
    with session_scope() as session:
        raw_connection(session).execute("SELECT pg_advisory_xact_lock(%s)", (AdvisoryLock.PROJECTION,))


def stored_task_histories(conn: psycopg.Connection, chunk: int = 5000) -> dict[uuid.UUID, TaskHistory]:
    """The task history of every stored trajectory with a task, from the finalized ones and the
    provisional ones whose window has closed (their finalization at ``window_closes_at`` with the
    signals they hold is decided; only the sweep has not stored it yet: ``consumers.finalize``).

    Raises:
        psycopg.Error: database faults.
    """
    with conn.cursor(name=f"histories_{uuid.uuid4().hex[:8]}") as cur:
        cur.itersize = chunk
        cur.execute(
            "SELECT id, task_id, coalesce(finalized_at, window_closes_at), signals FROM trajectory "
            "WHERE task_id IS NOT NULL AND (status = 'finalized' OR window_closes_at < clock_timestamp())"
        )
        return task_histories((tid, task, at, trajectory_outcome(signals)) for tid, task, at, signals in cur)


@dataclass
class RelabelReport:
    """Before/after reward distributions of one relabel."""

    spec: str
    baseline: str
    before: dict[str, float | None] = field(default_factory=dict)
    after: dict[str, float | None] = field(default_factory=dict)
    relabeled: int = 0
    changed: int = 0
    late_signals_used: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "spec": self.spec,
            "baseline": self.baseline,
            "relabeled": self.relabeled,
            "changed": self.changed,
            "late_signals_used": self.late_signals_used,
            "before": self.before,
            "after": self.after,
        }


def relabel(spec_id: str, *, baseline: str | None = None, chunk: int = 2000) -> RelabelReport:
    """Label every finalized trajectory with ``spec_id``, replacing labels of that spec.

    Args:
        baseline: the spec whose labels are "before"; default ``spec_id`` itself if it has labels,
            else the first active spec.
        chunk: labels staged per statement while scanning.
    Raises:
        ConfigurationError: unknown spec.
    """
    spec: RewardSpec = load_spec(spec_id)
    projector = Projector(ProjectionConfig(relabel=True), [spec])
    with session_scope() as session:
        conn = raw_connection(session)
        if baseline is None:
            has_own = conn.execute("SELECT 1 FROM reward_label WHERE spec = %s LIMIT 1", (spec.id,)).fetchone()
            baseline = spec.id if has_own else active_specs()[0].id
        report = RelabelReport(spec=spec.id, baseline=baseline)
        before: dict[uuid.UUID, float] = dict(
            conn.execute("SELECT trajectory_id, reward FROM reward_label WHERE spec = %s", (baseline,)).fetchall()
        )
        report.before = distribution(list(before.values()))
        finalized: dict[str, uuid.UUID] = dict(
            conn.execute("SELECT session_id, id FROM trajectory WHERE status = 'finalized'").fetchall()
        )
        late = {
            r[0]: set(r[1])
            for r in conn.execute(
                "SELECT id, late_event_ids FROM trajectory WHERE status = 'finalized' "
                "AND cardinality(late_event_ids) > 0"
            ).fetchall()
        }
        histories: dict[uuid.UUID, TaskHistory] = {}
        if spec.needs_task_history:
            settle_finalizations()  # after reading `finalized`: each one's earlier trajectories are stored now
            histories = stored_task_histories(conn)
        trepo.create_label_stage(session)
        labels: list[tuple[uuid.UUID, RewardResult]] = []
        late_used: dict[uuid.UUID, int] = {}  # trajectory id -> late signals its new label counted

        def close(t: TrajectoryState | None) -> None:
            if t is None:
                return
            labels.append((t.id, projector.label(t, histories.get(t.id, TaskHistory()))[0]))
            if len(labels) >= chunk:
                trepo.stage_labels(session, labels)
                labels.clear()

        where = "session_id IN (SELECT session_id FROM trajectory WHERE status = 'finalized')"
        current: TrajectoryState | None = None
        for rows in iter_stored_rows(conn, order="session", where=where):  # archived days too
            for row in rows:
                se = stored_event_from_row(row)
                if se.event.session_id not in finalized:
                    continue
                if current is None or current.session_id != se.event.session_id:
                    close(current)
                    current = new_trajectory(se.event)
                projector.apply(current, se)
                if se.event.event_id in late.get(current.id, ()):
                    late_used[current.id] = late_used.get(current.id, 0) + 1
        close(current)
        trepo.stage_labels(session, labels)
        # Only now are trajectories locked (briefly, till the commit): a user erased meanwhile is skipped.
        written = trepo.apply_staged_labels(session)
        report.relabeled = len(written)
        report.changed = sum(1 for tid, r in written if tid in before and abs(before[tid] - r) > 1e-9)
        report.late_signals_used = sum(late_used.get(tid, 0) for tid, _ in written)
        report.after = distribution([r for _, r in written])
    return report

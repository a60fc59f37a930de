"""The window sweep: finalize provisional trajectories whose late-signal window has closed.

Invariant: the sweep only materializes what the fold already decided (see ``consumers.projection``):
a trajectory whose window closed at ``window_closes_at`` is finalized *at* that instant with the
signals it had, whoever gets there first (the sweep, or a batch meeting a late event). It runs in
the consume loop every ``finalize_interval_s`` and as ``flywheel finalize``; several consumers may
sweep at once (``FOR UPDATE SKIP LOCKED``). It leaves alone windows closed less than
``finalize_grace_s`` ago, so a batch that began before the close has normally committed by then; one
that has not (it waited on a lock) and meets the finalized trajectory is redone with a later
ingestion time (``consumers.batch.SweepOvertook``): the grace makes that redo rare, it is not what
keeps the live rows equal to a replay.
"""

from __future__ import annotations

from collections import Counter

from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.locks import AdvisoryLock
from app.repositories import trajectories as trepo
from app.repositories.events import fetch_value, raw_connection
from consumers.projection import Projector
from consumers.trajectory_state import TrajectoryState


def finalize_due_once(session: Session, projector: Projector, grace_s: float, limit: int = 500) -> Counter[str]:
    """Finalize up to ``limit`` due trajectories in the caller's transaction.

    Returns:
        Counter of finalizations by kind (``window`` / ``abandoned``).
    """
    # shared like an ingest batch: an in-place replay (exclusive) never interleaves with a sweep
    now = fetch_value(
        raw_connection(session), "SELECT now(), pg_advisory_xact_lock_shared(%s)", (AdvisoryLock.PROJECTION,)
    )
    due = trepo.due_for_window(session, now, grace_s, TrajectoryState, limit=limit)
    done: Counter[str] = Counter()
    for t in due.values():
        # The window closed before `now - grace`, so any instant past it triggers the close.
        if projector.close_if_due(t, now):
            assert t.finalized_by is not None  # set by the close
            done[t.finalized_by] += 1
    trepo.save_trajectories(session, list(due.values()))
    return done


def finalize_due(projector: Projector, grace_s: float, limit: int = 500) -> Counter[str]:
    """Sweep until nothing is due, one transaction per ``limit`` trajectories.

    Raises:
        sqlalchemy.exc.OperationalError: the database is unreachable (callers retry).
    """
    total: Counter[str] = Counter()
    while True:
        with session_scope() as session:
            done = finalize_due_once(session, projector, grace_s, limit)
        total.update(done)
        if sum(done.values()) < limit:
            return total

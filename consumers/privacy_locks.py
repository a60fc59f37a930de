"""Privacy-mode sessions across group members: session locks, the sessions a batch flags, and
publishing them private ahead of the batch.

Invariants:
- A privacy-mode session is private whole: :func:`publish_private_sessions` deletes what is stored
  of it (events, trajectory; ``consumers.erasure.purge_private_sessions``), records its tombstone
  (with the events deleted) and is a no-op for a session already private.
- A record flags its session private by a valid event's ``privacy_mode`` or by what a dead letter's
  bytes claim (:func:`privacy_flagged_sessions`): a record failing validation does not void the
  request.
- Session locks are transaction-scoped advisory locks in :data:`PRIVACY_LOCK_SPACE`, one per bucket
  of session ids (:func:`session_lock_bucket`, the same in every process), taken in bucket order in
  one round trip (:func:`lock_sessions`), so two transactions never wait on each other in a cycle. A
  bucket holding any exclusively locked session is taken exclusively.
- Publishing holds the session locks exclusively only for its own short transaction, which runs
  before the batch's and holds nothing else: it waits for the batches holding those sessions (which
  then have committed) and deletes what they stored. A batch takes the locks of the sessions it
  stored shared, after storing them, until it commits, and deletes what it finds private then
  (``consumers.batch.apply_batch``).
- Publishing locks the sessions' trajectory rows before their session locks: a batch holds the
  trajectory rows it folds into until it commits and takes its shared session locks at its end, so
  the two never wait on each other in a cycle.
"""

from __future__ import annotations

import zlib
from collections.abc import Collection, Sequence

import psycopg
from sqlalchemy.orm import Session

from app.core.locks import PRIVACY_LOCK_SPACE
from app.repositories import trajectories as trepo
from app.repositories.events import count_tombstones, private_sessions, raw_connection
from consumers.classify import Decoded
from consumers.deadletter import Claim, claim_of_dead_letter
from consumers.erasure import purge_private_sessions
from consumers.trajectory_state import TrajectoryState, trajectory_id_for

PRIVACY_LOCK_BUCKETS = 256
"""Session-lock buckets: a batch holds at most this many advisory locks (Postgres's lock table is
shared, ``max_locks_per_transaction`` x connections); more buckets, fewer false waits."""


def session_lock_bucket(session_id: str) -> int:
    """The :data:`PRIVACY_LOCK_SPACE` lock key of a session id: CRC-32 of its UTF-8 bytes modulo
    :data:`PRIVACY_LOCK_BUCKETS` (the same in every process, unlike ``hash``)."""
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % PRIVACY_LOCK_BUCKETS


def lock_sessions(conn: psycopg.Connection, sessions: Collection[str], exclusive: Collection[str] = ()) -> None:
    """Take the session locks of ``sessions`` (shared) and ``exclusive`` (exclusive) until the
    transaction ends, in bucket order (so two batches never wait on each other in a cycle), in one
    round trip. A bucket holding any exclusive session is taken exclusively.

    Raises:
        psycopg.Error: database faults.
    """
    buckets: dict[int, bool] = {}
    for sid in sessions:
        buckets.setdefault(session_lock_bucket(sid), False)
    for sid in exclusive:
        buckets[session_lock_bucket(sid)] = True
    if not buckets:
        return
    keys = sorted(buckets)
    conn.execute(
        "SELECT CASE WHEN x THEN pg_advisory_xact_lock(%(space)s, k) "
        "ELSE pg_advisory_xact_lock_shared(%(space)s, k) END "
        "FROM unnest(%(keys)s::int[], %(x)s::bool[]) AS u(k, x)",
        {"space": PRIVACY_LOCK_SPACE, "keys": keys, "x": [buckets[k] for k in keys]},
    ).fetchall()


def privacy_flagged_sessions(batch: Sequence[Decoded], claims: Sequence[Claim | None] | None = None) -> set[str]:
    """The sessions that records of ``batch`` flag ``privacy_mode``: a valid event's flag, or what a
    dead letter's bytes claim (``consumers.deadletter.claim_of``: unvalidated, but a request for
    privacy errs toward privacy; the record failing validation does not make the user's wish void).
    ``claims``: the records' :func:`claim_of_dead_letter` (None for an event), if the caller has them."""
    if claims is None:
        claims = [claim_of_dead_letter(d) if d.reason is not None else None for d in batch]
    return {d.event.session_id for d in batch if d.event is not None and d.event.privacy_mode} | {
        c.session_id for c in claims if c is not None and c.privacy_mode and c.session_id
    }


def publish_private_sessions(session: Session, flagged: Collection[str]) -> dict[str, int]:
    """Make the ``flagged`` sessions (:func:`privacy_flagged_sessions` of a batch) private, whole, in
    the caller's transaction, which should hold nothing else and commit right after (the batch's
    own transaction follows): locks their stored trajectories, then their session locks
    exclusively (so a batch of another member holding their events has committed), deletes what is
    stored of them (:func:`consumers.erasure.purge_private_sessions`) and records their tombstones,
    counting what it deleted. Sessions already private are left alone.

    Returns:
        ``{session_id: events deleted}`` of the sessions it made private.
    Raises:
        psycopg.Error: database faults (nothing is published).
    """
    flagged = sorted(flagged)
    todo = sorted(set(flagged) - private_sessions(session, flagged)) if flagged else []
    if not todo:
        return {}
    # Trajectory rows before session locks: a batch folding into one holds its row until it commits
    # and takes session locks only at its end, so this order cannot close a cycle with it.
    trepo.load_trajectories(session, map(trajectory_id_for, todo), TrajectoryState)
    lock_sessions(raw_connection(session), (), todo)
    todo = sorted(set(todo) - private_sessions(session, todo))  # another member's publishing won the race
    purged = purge_private_sessions(session, todo)
    dropped = {sid: purged.get(sid, 0) for sid in todo}  # a tombstone even where nothing was stored yet
    count_tombstones(session, dropped)
    return dropped

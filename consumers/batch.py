"""One Kafka batch -> one Postgres transaction: events, projections, dead letters, offsets.

Invariants (exactly-once effect):

- The batch's consumer offsets are locked ``FOR UPDATE`` first; a record below the stored next
  offset was already applied (by this process before a crash, or by another member of the group
  before a rebalance) and is skipped. Offsets advance in the same transaction as the effects.
- ``event_log`` appends use ``ON CONFLICT (event_id) DO NOTHING``; only newly stored events are
  folded into the projections, in ``seq`` order, so a producer's duplicate is a no-op too. A record
  whose ``event_id`` is stored with a different body (``app.repositories.events.BODY_COLUMNS``) is
  not a duplicate but a conflict: the stored event stays, the record is a dead letter
  ``conflicting_duplicate``.
- Each trajectory folds its events in ``seq`` order, as replay does, even when a session's events
  arrive on two partitions (two members): the batch locks the stored trajectories it touches before
  it reserves ``seq`` values, and two members creating the same trajectory collide on its key.
- A trajectory the window sweep finalized at an instant this batch's ingestion time is not past
  (the batch began before the close, then waited on a lock while the sweep ran) would take the
  batch's events as late, where a replay, judging them by their ``ingested_at``, folds them in: the
  batch is redone in a new transaction instead (:class:`SweepOvertook`, retried as transient), whose
  later ingestion time makes the events late in both. So the sweep's grace period only makes this
  rare; correctness does not depend on it.
- Privacy-mode sessions are never stored: their events only increment ``privacy_tombstone``. A
  session flagged part-way (privacy turned on mid-session) is private whole: at its first flagged
  event, what was stored of it (events, trajectory) is deleted and counted in its tombstone. Their
  dead letters keep their place and reason, not their bytes: one whose bytes claim ``privacy_mode``
  or a private session is stored so, and a session's first flag strips those already stored. A dead
  letter whose bytes claim ``privacy_mode`` for a session flags that session as a valid event would
  (:func:`privacy_flagged_sessions`): the record failing validation does not void the request.
  Between group members too, for a session split over partitions (a producer that does not key by
  session), with session locks (``PRIVACY_LOCK_SPACE``, one advisory lock per bucket of session
  ids, taken in bucket order): before a batch's transaction, :func:`publish_private_sessions` makes
  the sessions its events flag private in a short transaction of its own, holding their locks
  exclusively (it waits for the batches holding them, which then have committed, and deletes what
  they stored of those sessions). A batch reads which sessions are private when it begins (their
  events are dropped) and, after storing its events, takes the locks of the sessions it stored
  shared until it commits and reads again: a session made private meanwhile is deleted by the batch
  itself. So exclusive holds are short: the flag's batch no longer holds up the others for its
  whole transaction. (:func:`apply_batch` without the publishing step first, as the record-isolating
  path runs it, takes the exclusive locks itself for its whole transaction, as before.)
- ``user.erasure_requested`` is applied at its place in the batch (events before it are stored,
  then erased with the rest of the user's data), holding the projection lock exclusively: no other
  member's batch is half-way through the user's events when it deletes them. After it, the user's
  events it covers are dropped at ingest, and the dead letters it covers (by what their bytes claim)
  are stored without their bytes.
- Every batch transaction holds the projection lock (``PROJECTION_LOCK``, an advisory lock): shared,
  or exclusive if the batch holds an erasure request; an in-place replay takes it exclusively, so it
  never interleaves with ingest.
"""

from __future__ import annotations

import uuid
import zlib
from collections import Counter
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from app.core.retry import TransientError
from app.repositories import trajectories as trepo
from app.repositories.events import (DeadLetterRow, append_events, count_tombstones, erased_users,
                                     insert_dead_letters, lock_offsets, private_sessions, raw_connection,
                                     store_offsets)
from consumers.deadletter import (Claim, Decoded, claim_of_dead_letter, conflicting_duplicates, covered_by_erasure,
                                  dead_letter_row, redacted, redacted_private)
from consumers.erasure import ErasureOutcome, erase_user, purge_private_sessions
from consumers.projection import (Projector, SegmentState, StoredEvent, TrajectoryState, new_trajectory,
                                  trajectory_id_for)

PROJECTION_LOCK = 0x666C7977  # "flyw"
PRIVACY_LOCK_SPACE = 0x70727679  # "prvy": two-key advisory locks (space, bucket of session ids)
PRIVACY_LOCK_BUCKETS = 256
"""Session-lock buckets: a batch holds at most this many advisory locks (Postgres's lock table is
shared, ``max_locks_per_transaction`` x connections); more buckets, fewer false waits."""


class SweepOvertook(TransientError):
    """The window sweep finalized a trajectory of this batch at or after the batch's ingestion time
    (``now()``): folding the batch's events would diverge from a replay. Transient: redo the batch
    in a new transaction (``app.core.retry.is_transient``)."""


_SUMMED = ("stale", "stored", "duplicates", "privacy_dropped", "erased_dropped", "trajectories")
"""The integer counts a batch outcome and the run totals both add up."""


def _add_counts(total, o: "BatchOutcome") -> None:
    for name in _SUMMED:
        setattr(total, name, getattr(total, name) + getattr(o, name))
    total.dead_letters.update(o.dead_letters)
    total.finalized.update(o.finalized)


@dataclass
class BatchOutcome:
    """Counts of what one batch did (for metrics and tests)."""

    messages: int = 0
    stale: int = 0
    stored: int = 0
    """events appended to ``event_log``, less those of sessions the batch itself then purged as private
    (counted in ``privacy_dropped``, the sessions' tombstones); events an erasure request later in the
    batch deleted count here and in that request's ``events_deleted``."""
    duplicates: int = 0
    dead_letters: Counter = field(default_factory=Counter)
    privacy_dropped: int = 0
    erased_dropped: int = 0
    erasures: list[ErasureOutcome] = field(default_factory=list)
    finalized: Counter = field(default_factory=Counter)
    trajectories: int = 0
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    dead_letter_positions: list[tuple[str, int, int]] = field(default_factory=list)
    """(topic, partition, offset) of the dead letters the batch stored (an erasure later in the batch may
    have deleted some again): what the caller publishes to the DLQ topic before it commits."""
    offset_gaps: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(topic, partition) -> (the group's stored next offset, the batch's first offset on it) where the
    batch starts past the stored offset: the broker no longer had the records in between when the
    group read on (retention deleted them before they were consumed), so their events never reach
    the store. The offsets advance past them; the caller reports the loss."""

    def merge(self, o: "BatchOutcome") -> None:
        """Add another outcome's counts (its ``messages`` excluded: the caller counted them)."""
        _add_counts(self, o)
        self.erasures += o.erasures
        self.dead_letter_positions += o.dead_letter_positions
        for k, gap in o.offset_gaps.items():
            self.offset_gaps.setdefault(k, gap)
        for k, v in o.next_offsets.items():
            self.next_offsets[k] = max(self.next_offsets.get(k, 0), v)


@dataclass
class IngestStats:
    """Totals of one ``run``."""

    messages: int = 0
    stored: int = 0
    duplicates: int = 0
    stale: int = 0
    privacy_dropped: int = 0
    erased_dropped: int = 0
    trajectories: int = 0
    """trajectory writes (a trajectory counts once per batch that folded events into it)."""
    erasures: int = 0
    """erasure requests applied."""
    dead_letters: Counter = field(default_factory=Counter)
    finalized: Counter = field(default_factory=Counter)
    batches: int = 0
    processing_errors: int = 0
    first_record_at: float | None = None
    """``time.monotonic()`` when the first record was polled (after the group join)."""
    last_batch_at: float | None = None
    """``time.monotonic()`` when the last batch was committed."""

    def add(self, o: BatchOutcome) -> None:
        """Fold one batch's counts in."""
        self.messages += o.messages
        _add_counts(self, o)
        self.erasures += len(o.erasures)
        self.batches += 1


def project_events(session: Session, projector: Projector, events: list[StoredEvent],
                   finalized: Counter | None = None,
                   states: dict[uuid.UUID, TrajectoryState] | None = None) -> int:
    """Fold stored events (any order; folded by ``seq``) into their trajectories and write them back.

    ``states``: the events' stored trajectories, already loaded (and locked) by the caller; loaded
    here (locked ``FOR UPDATE``) if None.

    Returns:
        trajectories written.
    """
    if not events:
        return 0
    events = sorted(events, key=lambda e: e.seq)
    tids = {sid: trajectory_id_for(sid) for sid in {se.event.session_id for se in events}}
    if states is None:
        states = trepo.load_trajectories(session, set(tids.values()), TrajectoryState)
    stored_max: dict[uuid.UUID, int] = {}
    for tid, seg in trepo.load_open_segments(session, states, SegmentState).items():
        states[tid].segments[seg.segment_index] = seg
        stored_max[tid] = seg.segment_index
    # Only an index below the stored open segment can exist unloaded (out-of-order turns).
    projector.load_segment = (lambda tid, idx: trepo.load_segment(session, tid, idx, SegmentState)
                              if idx < stored_max.get(tid, -1) else None)
    for se in events:
        tid = tids[se.event.session_id]
        t = states.get(tid)
        if t is None:
            t = states[tid] = new_trajectory(se.event)
        was = t.status
        projector.apply(t, se)
        if finalized is not None and t.status == "finalized" and was != "finalized":
            finalized[t.finalized_by] += 1
    written, _, _ = trepo.save_trajectories(session, list(states.values()))
    return written


def _store_and_project(session: Session, projector: Projector, chunk: list[Decoded], now: datetime,
                       method: str, out: BatchOutcome) -> Counter:
    """Append ``chunk``'s events, fold the new ones into their trajectories, count them in ``out``.

    Returns:
        events newly stored, per session id.
    """
    if not chunk:
        return Counter()
    # Lock the chunk's stored trajectories BEFORE reserving ``seq`` values for its events. Another
    # group member folding into one of them (a session split over partitions) has then either
    # committed before our lock (its events have lower seq values and are already folded in) or
    # waits for our commit (its seq values will be higher): each trajectory folds its events in seq
    # order, as replay does. A trajectory both create is settled by the unique key (see
    # ``trajectories._write_rows``): the loser redoes its batch and reserves later seq values.
    sessions = {d.event.session_id for d in chunk}  # type: ignore[union-attr]
    states = trepo.load_trajectories(session, map(trajectory_id_for, sessions), TrajectoryState)  # uuid5 per session
    for t in states.values():
        if t.status == "finalized" and t.finalized_by != "signals" and t.finalized_at >= now:
            raise SweepOvertook(f"trajectory {t.id} was finalized by its window at {t.finalized_at.isoformat()}, "
                                f"not before this batch's ingestion time {now.isoformat()}")
    rows = [d.row for d in chunk]
    inserted = {k.int: v for k, v in append_events(session, rows, method).items()}  # type: ignore[arg-type]
    stored: list[StoredEvent] = []
    duplicates: list[Decoded] = []
    for d in chunk:
        # pop: a second record with the same id in this batch is a duplicate, not a new event
        seq = inserted.pop(d.event.event_id.int, None)  # type: ignore[union-attr]
        if seq is not None:
            stored.append(StoredEvent(d.event, seq, now, d.msg.topic, d.msg.partition, d.msg.offset))
        else:
            duplicates.append(d)
    out.stored += len(stored)
    conflicts = conflicting_duplicates(session, duplicates)
    out.duplicates += len(duplicates) - len(conflicts)
    if conflicts:
        insert_dead_letters(session, [dead_letter_row(c) for c in conflicts])
        out.dead_letters["conflicting_duplicate"] += len(conflicts)
        out.dead_letter_positions += [(c.msg.topic, c.msg.partition, c.msg.offset) for c in conflicts]
    out.trajectories += project_events(session, projector, stored, out.finalized, states)
    return Counter(se.event.session_id for se in stored)


def session_lock_bucket(session_id: str) -> int:
    """The :data:`PRIVACY_LOCK_SPACE` lock key of a session id: CRC-32 of its UTF-8 bytes modulo
    :data:`PRIVACY_LOCK_BUCKETS` (the same in every process, unlike ``hash``)."""
    return zlib.crc32(session_id.encode("utf-8", "surrogatepass")) % PRIVACY_LOCK_BUCKETS


def lock_sessions(conn, sessions: Collection[str], exclusive: Collection[str] = ()) -> None:
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
    conn.execute("SELECT CASE WHEN x THEN pg_advisory_xact_lock(%(space)s, k) "
                 "ELSE pg_advisory_xact_lock_shared(%(space)s, k) END "
                 "FROM unnest(%(keys)s::int[], %(x)s::bool[]) AS u(k, x)",
                 {"space": PRIVACY_LOCK_SPACE, "keys": keys, "x": [buckets[k] for k in keys]}).fetchall()


def privacy_flagged_sessions(batch: Sequence[Decoded], claims: Sequence[Claim | None] | None = None) -> set[str]:
    """The sessions that records of ``batch`` flag ``privacy_mode``: a valid event's flag, or what a
    dead letter's bytes claim (``consumers.deadletter.claim_of``: unvalidated, but a request for
    privacy errs toward privacy; the record failing validation does not make the user's wish void).
    ``claims``: the records' :func:`claim_of_dead_letter` (None for an event), if the caller has them."""
    if claims is None:
        claims = [claim_of_dead_letter(d) if d.reason is not None else None for d in batch]
    return {d.event.session_id for d in batch if d.event is not None and d.event.privacy_mode} | \
        {c.session_id for c in claims if c is not None and c.privacy_mode and c.session_id}


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


def apply_batch(session: Session, group_id: str, batch: list[Decoded], projector: Projector,
                insert_method: str = "copy") -> BatchOutcome:
    """Apply classified records (in partition order) in the caller's transaction.

    Raises:
        psycopg.Error / sqlalchemy.exc.DBAPIError: database faults; nothing of the batch is kept.
        SweepOvertook: the window sweep raced the batch (redo it in a new transaction).
    """
    out = BatchOutcome(messages=len(batch))
    if not batch:
        return out
    conn = raw_connection(session)
    # A batch with an erasure request takes the projection lock exclusively: it waits for every other
    # member's batch in flight (one may hold the user's events, uncommitted, that the erasure must
    # delete) and holds back the next ones until it commits (they then see the request in
    # erased_users). Taken up front, not upgraded from shared: two upgrades would deadlock.
    erasing = any(d.event is not None and d.event.type == "user.erasure_requested" for d in batch)
    lock = "pg_advisory_xact_lock" if erasing else "pg_advisory_xact_lock_shared"
    now = conn.execute(f"SELECT now(), {lock}(%s)", (PROJECTION_LOCK,)).fetchone()[0]
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    for d in batch:
        k = (d.msg.topic, d.msg.partition)
        first[k] = min(first.get(k, d.msg.offset), d.msg.offset)
        last[k] = max(last.get(k, d.msg.offset), d.msg.offset)
    stored_next = lock_offsets(session, group_id, first)
    out.offset_gaps = {k: (stored_next[k], f) for k, f in first.items() if f > stored_next.get(k, f)}
    fresh = [d for d in batch if d.msg.offset >= stored_next.get((d.msg.topic, d.msg.partition), 0)]
    out.stale = len(batch) - len(fresh)

    # A dead letter is stored at its place in the batch relative to erasure requests, like an event:
    # one before a request is erased with the user's rows; one after it that the request covers (by
    # what its bytes claim) keeps its place and reason, not its bytes.
    claims = [claim_of_dead_letter(d) if d.reason is not None else None for d in fresh]
    events = [d for d in fresh if d.event is not None]
    sessions = {d.event.session_id for d in events} | {c.session_id for c in claims if c is not None and c.session_id}
    flagged = privacy_flagged_sessions(fresh, claims)
    private = private_sessions(session, list(sessions))
    if flagged - private:  # not published ahead (publish_private_sessions): hold every session lock from here on
        lock_sessions(conn, sessions, flagged - private)
        private = private_sessions(session, list(sessions))  # after the lock: a flag committed meanwhile is seen
    stored_sessions: set[str] = set()
    erased = erased_users(session, list({d.event.user_id for d in events}  # type: ignore[union-attr]
                                        | {c.user_id for c in claims if c is not None and c.user_id is not None}))
    tombstones: Counter = Counter()
    stored_per_session: Counter = Counter()
    newly_private: set[str] = set()
    chunk: list[Decoded] = []
    dead: list[DeadLetterRow] = []
    for d, claim in zip(fresh, claims):
        if claim is not None:
            row, requested_at = dead_letter_row(d, claim=claim), covered_by_erasure(claim, erased)
            if requested_at is not None:
                row = redacted(row, requested_at)
            elif claim.privacy_mode or claim.session_id in private:
                row = redacted_private(row)
                if claim.privacy_mode and claim.session_id and claim.session_id not in private:
                    newly_private.add(claim.session_id)  # what was stored of it goes, as for an event's flag
                    private.add(claim.session_id)
                    tombstones[claim.session_id] += 0  # the session's tombstone, counting events only
            dead.append(row)
            out.dead_letters[d.reason] += 1
            out.dead_letter_positions.append((d.msg.topic, d.msg.partition, d.msg.offset))
            continue
        ev = d.event
        assert ev is not None
        if ev.type == "user.erasure_requested":
            stored_per_session += _store_and_project(session, projector, chunk, now, insert_method, out)
            insert_dead_letters(session, dead)
            chunk, dead = [], []
            res = erase_user(session, ev.user_id, ev.payload.request_id, ev.occurred_at)  # type: ignore[attr-defined]
            out.erasures.append(res)
            at, tids = erased.get(ev.user_id, (ev.occurred_at, set()))
            erased[ev.user_id] = (max(at, ev.occurred_at), tids | set(res.trajectory_ids))
            continue
        if ev.privacy_mode or ev.session_id in private:
            if ev.session_id not in private:  # the session's first flag: what was stored of it goes too
                newly_private.add(ev.session_id)
            private.add(ev.session_id)
            tombstones[ev.session_id] += 1
            continue
        if ev.user_id in erased:
            requested_at, erased_ids = erased[ev.user_id]
            if ev.occurred_at <= requested_at or trajectory_id_for(ev.session_id) in erased_ids:
                out.erased_dropped += 1
                continue
        chunk.append(d)
        stored_sessions.add(ev.session_id)
    insert_dead_letters(session, dead)
    stored_per_session += _store_and_project(session, projector, chunk, now, insert_method, out)
    # A session flagged part-way (its events before the flag stored, here or by earlier batches)
    # becomes private whole: those events and its trajectory are deleted and counted as dropped.
    tombstones.update(purge_private_sessions(session, newly_private))
    # A session another member made private since this batch read the private ones: deleted here,
    # under its lock (the publisher waits for it, or this batch for the publisher's commit).
    stored_sessions |= {c.session_id for c in claims if c is not None and c.session_id}  # dead letters' bytes
    stored_sessions -= newly_private
    lock_sessions(conn, stored_sessions)
    purged_late = purge_private_sessions(session, private_sessions(session, list(stored_sessions)))
    tombstones.update(purged_late)
    count_tombstones(session, dict(tombstones))
    out.privacy_dropped = sum(tombstones.values())
    # What this batch stored of a session it then purged is counted once, as dropped (its tombstone).
    out.stored -= sum(stored_per_session[sid] for sid in newly_private | purged_late.keys())
    out.next_offsets = {k: v + 1 for k, v in last.items()}
    store_offsets(session, group_id, out.next_offsets)
    return out

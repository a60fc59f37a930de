"""One Kafka batch -> one Postgres transaction: events, projections, dead letters, offsets.

Invariants (exactly-once effect):

- The offset fence (:func:`_offset_fence`): the batch's consumer offsets are locked ``FOR UPDATE``
  before any effect; a record below the stored next offset was already applied (by this process
  before a crash, or by another member of the group before a rebalance) and is skipped, and so is
  a record of another log than the one the stored offset counts in (``consumer_offset.log_id``).
  The offsets and their log's identity advance in the same transaction as the effects, after
  them, and only if they all succeeded.
- ``event_log`` appends skip stored ids (``ON CONFLICT (event_id, occurred_at) DO NOTHING``, or the
  lookup within the dedupe window: ``app.repositories.events``); only newly stored events are
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
  (``consumers.privacy_locks.privacy_flagged_sessions``).
- Between group members too, for a session split over partitions, with the session locks of
  ``consumers.privacy_locks``: a batch reads which sessions are private when it begins (their
  events are dropped) and, after storing its events, takes the locks of the sessions it stored
  shared until it commits and reads again: a session made private meanwhile (by
  ``publish_private_sessions``, which the consumer runs ahead of each batch in a short transaction
  of its own) is deleted by the batch itself. A batch whose flagged sessions were not published
  ahead (the record-isolating path, ``consumers.isolation``, runs :func:`apply_batch` alone) takes
  their locks exclusively itself, for its whole transaction.
- ``user.erasure_requested`` is applied at its place in the batch (events before it are stored,
  then erased with the rest of the user's data), holding the projection lock exclusively: no other
  member's batch is half-way through the user's events when it deletes them. After it, the user's
  events it covers are dropped at ingest, and the dead letters it covers (by what their bytes claim)
  are stored without their bytes.
- Every batch transaction holds the projection lock (``AdvisoryLock.PROJECTION``, an advisory lock): shared,
  or exclusive if the batch holds an erasure request; an in-place replay takes it exclusively, so it
  never interleaves with ingest.
"""

from __future__ import annotations

import uuid
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime, timedelta

import psycopg
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock
from app.core.retry import TransientError
from app.core.settings import get_settings
from app.repositories import trajectories as trepo
from app.repositories.events import (
    DeadLetterRow,
    append_events,
    count_tombstones,
    erased_users,
    fetch_value,
    insert_dead_letters,
    private_sessions,
    raw_connection,
)
from app.repositories.offsets import lock_offsets, offset_log_ids, store_offsets
from consumers.classify import Decoded, conflicting_duplicates
from consumers.counts import BatchOutcome
from consumers.deadletter import (
    claim_of_dead_letter,
    covered_by_erasure,
    dead_letter_row,
    redacted,
    redacted_private,
)
from consumers.erasure import erase_user, purge_private_sessions
from consumers.privacy_locks import lock_sessions, privacy_flagged_sessions
from consumers.projection import Projector, StoredEvent
from consumers.trajectory_state import SegmentState, TrajectoryState, new_trajectory, trajectory_id_for


class SweepOvertook(TransientError):
    """The window sweep finalized a trajectory of this batch at or after the batch's ingestion time
    (``now()``): folding the batch's events would diverge from a replay. Transient: redo the batch
    in a new transaction (``app.core.retry.is_transient``)."""


def apply_batch(
    session: Session, group_id: str, batch: list[Decoded], projector: Projector, insert_method: str = "copy"
) -> BatchOutcome:
    """Apply classified records (in partition order) in the caller's transaction: the projection
    lock, then the offset fence around the records' effects.

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
    now = fetch_value(conn, f"SELECT now(), {lock}(%s)", (AdvisoryLock.PROJECTION,))
    with _offset_fence(session, group_id, batch, out) as fresh:
        _apply_records(session, conn, fresh, projector, now, insert_method, out)
    return out


@contextmanager
def _offset_fence(session: Session, group_id: str, batch: list[Decoded], out: BatchOutcome) -> Iterator[list[Decoded]]:
    """The exactly-once offset fence of one batch, in the caller's transaction. On entry: lock the
    group's stored next offsets of the batch's partitions ``FOR UPDATE`` and yield the records at or
    past them (those below were applied already: counted in ``out.stale``; a batch starting past its
    stored offset is counted in ``out.offset_gaps``). On a clean exit (the block raised nothing):
    store, per partition, the offset after the batch's last record (``out.next_offsets``) and the
    identity of the log it was read from (``Message.log_id``). A block that raises stores nothing.
    Records read from another log than the one the stored offset counts in (a member that has not
    yet seen the log re-created, or still holds records of the old one) are skipped, counted stale
    and in ``out.foreign_log``; that partition's offset is left as stored.
    """
    first: dict[tuple[str, int], int] = {}
    last: dict[tuple[str, int], int] = {}
    log_ids: dict[tuple[str, int], str] = {}
    for d in batch:
        k = (d.msg.topic, d.msg.partition)
        first[k] = min(first.get(k, d.msg.offset), d.msg.offset)
        last[k] = max(last.get(k, d.msg.offset), d.msg.offset)
        if d.msg.log_id is not None:
            log_ids[k] = d.msg.log_id
    stored_next = lock_offsets(session, group_id, first)
    stored_ids = offset_log_ids(session, group_id, list(log_ids)) if log_ids else {}
    foreign = {k for k, i in log_ids.items() if stored_ids.get(k, i) != i}
    for k in foreign:
        out.foreign_log[k] = (stored_ids[k], log_ids[k])
        first.pop(k)
        last.pop(k)
    out.offset_gaps = {k: (stored_next[k], f) for k, f in first.items() if f > stored_next.get(k, f)}
    fresh = [
        d
        for d in batch
        if (k := (d.msg.topic, d.msg.partition)) not in foreign and d.msg.offset >= stored_next.get(k, 0)
    ]
    out.stale = len(batch) - len(fresh)
    yield fresh
    out.next_offsets = {k: v + 1 for k, v in last.items()}
    store_offsets(session, group_id, out.next_offsets, log_ids)


def _apply_records(
    session: Session,
    conn: psycopg.Connection,
    fresh: list[Decoded],
    projector: Projector,
    now: datetime,
    insert_method: str,
    out: BatchOutcome,
) -> None:
    """Store the effects of ``fresh`` (the records past the offset fence) in order, counting them in
    ``out``: dead letters, events, erasure requests at their place, privacy-mode sessions dropped
    and purged (the module's invariants).

    Raises:
        psycopg.Error / sqlalchemy.exc.DBAPIError: database faults.
        SweepOvertook: the window sweep raced the batch.
    """
    # A dead letter is stored at its place in the batch relative to erasure requests, like an event:
    # one before a request is erased with the user's rows; one after it that the request covers (by
    # what its bytes claim) keeps its place and reason, not its bytes.
    claims = [claim_of_dead_letter(d) if d.reason is not None else None for d in fresh]
    events = [d.event for d in fresh if d.event is not None]
    sessions = {e.session_id for e in events} | {c.session_id for c in claims if c is not None and c.session_id}
    flagged = privacy_flagged_sessions(fresh, claims)
    private = private_sessions(session, list(sessions))
    if flagged - private:  # not published ahead (publish_private_sessions): hold every session lock from here on
        lock_sessions(conn, sessions, flagged - private)
        private = private_sessions(session, list(sessions))  # after the lock: a flag committed meanwhile is seen
    stored_sessions: set[str] = set()
    erased = erased_users(
        session,
        list({e.user_id for e in events} | {c.user_id for c in claims if c is not None and c.user_id is not None}),
    )
    tombstones: Counter[str] = Counter()
    stored_per_session: Counter[str] = Counter()
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
            assert d.reason is not None  # a claim is made of dead letters only
            out.dead_letters[d.reason] += 1
            out.dead_letter_positions.append((d.msg.topic, d.msg.partition, d.msg.offset, d.msg.log_id))
            continue
        ev = d.event
        assert ev is not None
        if ev.type == "user.erasure_requested":
            stored_per_session += _store_and_project(session, projector, chunk, now, insert_method, out)
            insert_dead_letters(session, dead)
            chunk, dead = [], []
            res = erase_user(session, ev.user_id, ev.payload.request_id, ev.occurred_at)
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


def project_events(
    session: Session,
    projector: Projector,
    events: list[StoredEvent],
    finalized: Counter[str] | None = None,
    states: dict[uuid.UUID, TrajectoryState] | None = None,
) -> int:
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
    projector.load_segment = lambda tid, idx: (
        trepo.load_segment(session, tid, idx, SegmentState) if idx < stored_max.get(tid, -1) else None
    )
    for se in events:
        tid = tids[se.event.session_id]
        t = states.get(tid)
        if t is None:
            t = states[tid] = new_trajectory(se.event)
        was = t.status
        projector.apply(t, se)
        if finalized is not None and t.status == "finalized" and was != "finalized" and t.finalized_by is not None:
            finalized[t.finalized_by] += 1
    written, _, _ = trepo.save_trajectories(session, list(states.values()))
    return written


def _store_and_project(
    session: Session, projector: Projector, chunk: list[Decoded], now: datetime, method: str, out: BatchOutcome
) -> Counter[str]:
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
        if (
            t.status == "finalized"
            and t.finalized_by != "signals"
            and t.finalized_at is not None
            and t.finalized_at >= now
        ):
            raise SweepOvertook(
                f"trajectory {t.id} was finalized by its window at {t.finalized_at.isoformat()}, "
                f"not before this batch's ingestion time {now.isoformat()}"
            )
    rows = [d.row for d in chunk]
    window = timedelta(seconds=get_settings().events.dedupe_window_s)
    inserted = {k.int: v for k, v in append_events(session, rows, method, window).items()}  # type: ignore[arg-type]
    stored: list[StoredEvent] = []
    duplicates: list[Decoded] = []
    for d in chunk:
        ev = d.event
        assert ev is not None  # a chunk holds decoded events only
        # pop: a second record with the same id in this batch is a duplicate, not a new event
        seq = inserted.pop(ev.event_id.int, None)
        if seq is not None:
            stored.append(StoredEvent(ev, seq, now, d.msg.topic, d.msg.partition, d.msg.offset))
        else:
            duplicates.append(d)
    out.stored += len(stored)
    conflicts = conflicting_duplicates(session, duplicates)
    out.duplicates += len(duplicates) - len(conflicts)
    if conflicts:
        insert_dead_letters(session, [dead_letter_row(c) for c in conflicts])
        out.dead_letters["conflicting_duplicate"] += len(conflicts)
        out.dead_letter_positions += [(c.msg.topic, c.msg.partition, c.msg.offset, c.msg.log_id) for c in conflicts]
    out.trajectories += project_events(session, projector, stored, out.finalized, states)
    return Counter(se.event.session_id for se in stored)

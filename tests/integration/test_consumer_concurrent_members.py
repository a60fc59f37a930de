"""Group members applying batches concurrently, on a real Postgres.

Sessions whose events arrive on two partitions at once (a producer that does not key by session,
or the topic's partition count raised while sessions are live), applied by two members in
concurrent batch transactions: every event is stored once, nothing is lost, and the trajectories
equal a replay of ``event_log`` (which folds by ``seq``), whatever the interleaving. An erasure
request applied by one member while another is half-way through a batch of the same user's events
leaves none of them behind; so does a privacy flag applied by one member while another holds the
session's first events. A window sweep that finalizes a trajectory while a batch that began
before the close waits on a lock does not make the batch's events late where a replay would not.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections import defaultdict
from datetime import UTC

import psycopg
import pytest

from consumers.testing import generate_stream, kafka_record

pytestmark = pytest.mark.integration


def _messages_by_partition(events, split_at: float):
    """Each session's first ``split_at`` share of events on partition 0, the rest on partition 1."""
    from consumers.classify import Message

    per_session = defaultdict(list)
    for e in events:
        per_session[e.session_id].append(e)
    cut = {sid: max(1, int(len(evs) * split_at)) for sid, evs in per_session.items()}
    seen: dict[str, int] = defaultdict(int)
    parts: dict[int, list] = {0: [], 1: []}
    for e in events:
        p = 0 if seen[e.session_id] < cut[e.session_id] else 1
        seen[e.session_id] += 1
        parts[p].append(Message("t", p, len(parts[p]), *kafka_record(e)))
    return parts


def _classify(msgs):
    from consumers.classify import classify

    return [classify(m, 1 << 20) for m in msgs]


def _live_equals_replay(db, settings=None) -> None:
    from app.core.db import session_scope
    from consumers.ingest import projector_from_settings
    from consumers.replay import compare_projections, drop_schema, dump_projection, replay

    schema = f"replay_{uuid.uuid4().hex[:8]}"  # its own: a run killed half-way leaves one behind
    with session_scope() as s:
        live = dump_projection(s)
    replay(projector_from_settings(settings), grace_s=0.0, schema=schema)
    try:
        with session_scope() as s:
            rebuilt = dump_projection(s, schema)
        assert compare_projections(live, rebuilt) == []
    finally:
        with session_scope() as s:
            drop_schema(s, schema)


def _guarded(fn, errors: list[BaseException], done: threading.Event | None = None):
    """``fn`` as a thread target that appends what it raises to ``errors`` and sets ``done`` when it ends."""

    def run() -> None:
        try:
            fn()
        except BaseException as exc:  # noqa: BLE001 -- the test asserts ``errors`` is empty
            errors.append(exc)
        finally:
            if done is not None:
                done.set()

    return run


def _race(monkeypatch, b_apply, a_apply) -> None:
    """Run ``b_apply`` in thread member-b, which pauses (up to 2 s) right after storing its events
    in ``event_log``; start ``a_apply`` in thread member-a during that pause; wait for both.

    Raises:
        AssertionError: either raised, or B never stored its events.
    """
    import consumers.batch as batch_mod

    b_stored, a_done = threading.Event(), threading.Event()
    real_append = batch_mod.append_events

    def append_then_pause(session, rows, *args, **kwargs):
        out = real_append(session, rows, *args, **kwargs)
        if threading.current_thread().name == "member-b" and not b_stored.is_set():
            b_stored.set()
            a_done.wait(2.0)  # A gets every chance to overtake B here
        return out

    monkeypatch.setattr(batch_mod, "append_events", append_then_pause)
    errors: list[BaseException] = []
    tb = threading.Thread(target=_guarded(b_apply, errors), name="member-b")
    tb.start()
    assert b_stored.wait(30)
    ta = threading.Thread(target=_guarded(a_apply, errors, a_done), name="member-a")
    ta.start()
    tb.join(60)
    ta.join(60)
    assert not errors, errors


def _every_event_once(db, n: int) -> None:
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*), count(DISTINCT event_id) FROM event_log").fetchone() == (n, n)
        ids = [i for (a,) in conn.execute("SELECT event_ids FROM trajectory") for i in a]
        late = [i for (a,) in conn.execute("SELECT late_event_ids FROM trajectory") for i in a]
        assert len(ids) + len(late) == len(set(ids) | set(late)) == n
        assert conn.execute("SELECT count(*) FROM dead_letter").fetchone()[0] == 0


def _apply(msgs, outcomes: list | None = None):
    """A thread target applying ``msgs`` as one batch; its ``BatchOutcome`` is appended to ``outcomes``."""
    from app.core.db import session_scope
    from consumers.batch import apply_batch
    from consumers.ingest import projector_from_settings

    def run() -> None:
        with session_scope() as s:
            out = apply_batch(s, "g", _classify(msgs), projector_from_settings())
        if outcomes is not None:
            outcomes.append(out)

    return run


def test_a_member_that_stored_its_events_first_folds_them_first(db, monkeypatch):
    """Member B stores events (reserving the lower ``seq`` values) and pauses before folding them;
    member A, with later events of the same (existing) trajectories, runs meanwhile. A must not fold
    its later-``seq`` events in ahead of B's: a replay would fold B's first."""
    events = generate_stream(300, seed=31)
    parts = _messages_by_partition(events, split_at=0.5)
    first = [m for m in parts[0] if m.offset < 60]  # the sessions' trajectories exist before the race
    a_msgs = [m for m in parts[0] if m.offset >= 60]
    assert a_msgs and parts[1]
    _apply(first)()
    _race(monkeypatch, _apply(parts[1]), _apply(a_msgs))
    _every_event_once(db, len(events))
    _live_equals_replay(db)


def test_two_members_creating_the_same_trajectories_settle_without_dead_letters(db, monkeypatch, caplog):
    """Both members start the same new trajectories: B stores its events first, A creates the rows
    and commits, B's insert of the same rows then fails on the unique key. The consumer redoes B's
    batch (record-isolated, in a new transaction that loads A's rows): nothing is dead-lettered,
    nothing lost, and the rows equal a replay."""
    from consumers.ingest import IngestConsumer

    events = generate_stream(300, seed=32)
    parts = _messages_by_partition(events, split_at=0.5)
    members = {p: IngestConsumer(bootstrap="127.0.0.1:9", topic="t", group_id="g", client_id=f"m{p}") for p in parts}
    caplog.set_level(logging.INFO, logger="consumers.ingest")
    try:
        _race(monkeypatch, lambda: members[1].process(parts[1]), lambda: members[0].process(parts[0]))
    finally:
        for m in members.values():
            m.close()
    assert "batch raced another group member" in caplog.text  # the race did happen
    assert "bisecting" not in caplog.text
    assert members[1].stats.processing_errors == members[0].stats.processing_errors == 0
    assert members[0].stats.stored + members[1].stats.stored == len(events)
    _every_event_once(db, len(events))
    _live_equals_replay(db)


def test_an_erasure_waits_for_a_concurrent_batch_of_the_users_events(db, monkeypatch):
    """Member B has stored (not committed) events of a user's session and pauses; member A applies
    that user's erasure request meanwhile. The erasure must not commit around B's batch: none of the
    user's events or trajectories may survive it."""
    from datetime import datetime, timedelta

    import numpy as np

    from consumers.classify import Message
    from consumers.testing import generate_session
    from producers.events.types import UserErasureRequested, UserErasureRequestedEvent

    rng = np.random.default_rng(33)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    mine = generate_session(rng, session_id="s-erased", user_id="u-erased", start=t0)
    other = generate_session(rng, session_id="s-kept", user_id="u-kept", start=t0)
    request = UserErasureRequestedEvent(
        session_id="erasure-u", user_id="u-erased", payload=UserErasureRequested(request_id="req-race")
    )
    b_msgs = [Message("t", 1, i, *kafka_record(e)) for i, e in enumerate(mine + other)]
    a_msgs = [Message("t", 0, 0, *kafka_record(request))]
    _race(monkeypatch, _apply(b_msgs), _apply(a_msgs))
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id = 'u-erased'").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM trajectory WHERE user_id = 'u-erased'").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id = 'u-kept'").fetchone()[0] == len(other)
        assert conn.execute("SELECT events_deleted FROM erasure_request").fetchone()[0] == len(mine)


def test_a_privacy_flag_waits_for_a_concurrent_batch_of_the_sessions_events(db, monkeypatch):
    """A producer that does not key by session: member B has stored (not committed) the first events
    of a session and pauses; member A applies the rest of it, flagged ``privacy_mode`` (privacy turned
    on part-way), meanwhile. A must not commit around B's batch: nothing of the session may survive,
    and its tombstone counts every one of its events."""
    from datetime import datetime, timedelta

    import numpy as np

    from consumers.classify import Message
    from consumers.testing import generate_session

    rng = np.random.default_rng(35)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    private = generate_session(rng, session_id="s-private", user_id="u-p", start=t0)
    other = generate_session(rng, session_id="s-open", user_id="u-o", start=t0)
    cut = len(private) // 2
    flagged = [e.model_copy(update={"privacy_mode": True}) for e in private[cut:]]
    b_msgs = [Message("t", 1, i, *kafka_record(e)) for i, e in enumerate(private[:cut] + other)]
    a_msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(flagged)]
    a_out: list = []
    b_out: list = []
    _race(monkeypatch, _apply(b_msgs, b_out), _apply(a_msgs, a_out))
    with psycopg.connect(db) as conn:
        q = lambda sql: conn.execute(sql).fetchall()  # noqa: E731
        assert q("SELECT session_id, count(*) FROM event_log GROUP BY 1") == [("s-open", len(other))]
        assert q("SELECT session_id FROM trajectory") == [("s-open",)]
        assert q("SELECT session_id, events_dropped FROM privacy_tombstone") == [("s-private", len(private))]
    # B deleted what it had stored of the session itself: counted once, as dropped, not also as stored
    assert [(o.stored, o.privacy_dropped) for o in a_out + b_out] == [(0, len(flagged)), (len(other), cut)]


@pytest.mark.parametrize("stored_before", [False, True], ids=["new-session", "stored-trajectory"])
def test_a_flag_published_ahead_deletes_what_a_concurrent_batch_stores_of_the_session(
    db, monkeypatch, caplog, stored_before
):
    """As above, but member A runs as deployed (``IngestConsumer.process``): it publishes the
    session private in a short transaction of its own before its batch, and does not hold the
    session lock for its batch. B (no flag, so no lock held while it stores) finds the session
    private when it locks it after storing, and deletes its own rows. With the session's trajectory
    stored before the race, B holds its row while paused: A's publishing waits for B's commit
    and deletes B's rows itself. Either way nothing of the session survives, its tombstone counts
    every one of its events, and no deadlock is retried."""
    from datetime import datetime, timedelta

    import numpy as np

    from consumers.classify import Message
    from consumers.ingest import IngestConsumer
    from consumers.testing import generate_session

    rng = np.random.default_rng(36)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    private = generate_session(rng, session_id="s-private", user_id="u-p", start=t0)
    other = generate_session(rng, session_id="s-open", user_id="u-o", start=t0)
    first, cut = (3 if stored_before else 0), len(private) // 2
    if first:
        _apply([Message("t", 2, i, *kafka_record(e)) for i, e in enumerate(private[:first])])()
    flagged = [e.model_copy(update={"privacy_mode": True}) for e in private[cut:]]
    b_msgs = [Message("t", 1, i, *kafka_record(e)) for i, e in enumerate(private[first:cut] + other)]
    a_msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(flagged)]
    member = IngestConsumer(bootstrap="127.0.0.1:9", topic="t", group_id="g", client_id="a")
    try:
        _race(monkeypatch, _apply(b_msgs), lambda: member.process(a_msgs))
    finally:
        member.close()
    assert "retrying" not in caplog.text
    with psycopg.connect(db) as conn:
        q = lambda sql: conn.execute(sql).fetchall()  # noqa: E731
        assert q("SELECT session_id, count(*) FROM event_log GROUP BY 1") == [("s-open", len(other))]
        assert q("SELECT session_id FROM trajectory") == [("s-open",)]
        assert q("SELECT session_id, events_dropped FROM privacy_tombstone") == [("s-private", len(private))]


def test_two_members_applying_erasures_at_once_both_finish(db, monkeypatch, caplog):
    """Two erasure requests in concurrent batches (one after events of a third user) both take the
    projection lock exclusively: one waits for the other, neither deadlocks, both finish."""
    from datetime import datetime, timedelta

    import numpy as np

    from consumers.classify import Message
    from consumers.ingest import IngestConsumer
    from consumers.testing import generate_session
    from producers.events.types import UserErasureRequested, UserErasureRequestedEvent

    rng = np.random.default_rng(34)
    t0 = datetime.now(UTC) - timedelta(hours=1)
    users = {p: f"u-{p}" for p in (0, 1)}
    sessions = {p: generate_session(rng, session_id=f"s-{p}", user_id=users[p], start=t0) for p in users}
    requests = {
        p: UserErasureRequestedEvent(
            session_id=f"erasure-{p}", user_id=users[p], payload=UserErasureRequested(request_id=f"req-{p}")
        )
        for p in users
    }
    _apply([Message("t", 9, i, *kafka_record(e)) for i, e in enumerate(sessions[0] + sessions[1])])()
    kept = generate_session(rng, session_id="s-kept", user_id="u-kept", start=t0)
    parts = {
        0: [Message("t", 0, 0, *kafka_record(requests[0]))],
        1: [Message("t", 1, i, *kafka_record(e)) for i, e in enumerate(kept + [requests[1]])],
    }
    members = {p: IngestConsumer(bootstrap="127.0.0.1:9", topic="t", group_id="g", client_id=f"m{p}") for p in parts}
    try:
        _race(monkeypatch, lambda: members[1].process(parts[1]), lambda: members[0].process(parts[0]))
    finally:
        for m in members.values():
            m.close()
    assert "retrying" not in caplog.text  # no deadlock to retry
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id IN ('u-0', 'u-1')").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM trajectory WHERE user_id IN ('u-0', 'u-1')").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id = 'u-kept'").fetchone()[0] == len(kept)
        assert dict(conn.execute("SELECT request_id, events_deleted FROM erasure_request").fetchall()) == {
            "req-0": len(sessions[0]),
            "req-1": len(sessions[1]),
        }


def test_a_batch_the_window_sweep_overtook_is_redone_with_a_later_ingestion_time(db, monkeypatch, caplog):
    """Member B's batch (a late signal) begins before its trajectory's window closes, then waits (here:
    paused) while the sweep finalizes that trajectory at the close. Folding B's signal as late would
    differ from a replay, which judges it by its ``ingested_at`` (before the close) and folds it in.
    B is redone in a new transaction instead: its signal is then late in both, and live == replay."""
    import time
    from datetime import datetime, timedelta

    import numpy as np

    import consumers.batch as batch_mod
    from app.core.db import session_scope
    from consumers.classify import Message
    from consumers.finalize import finalize_due
    from consumers.ingest import IngestConsumer, projector_from_settings
    from consumers.settings import ConsumerSettings
    from consumers.testing import generate_session
    from producers.events.types import FollowupSent, FollowupSentEvent

    cs = ConsumerSettings(signal_window_s=1.0)
    rng = np.random.default_rng(35)
    events = generate_session(
        rng, session_id="s-swept", user_id="u", withhold_signal=True, start=datetime.now(UTC) - timedelta(hours=1)
    )
    end = next(i for i, e in enumerate(events) if e.type == "session.ended")
    late = events[end + 1 :] + [
        FollowupSentEvent(
            session_id="s-swept", user_id="u", payload=FollowupSent(text="still broken", dissatisfied=True)
        )
    ]
    msgs = [Message("t", 0, i, *kafka_record(e)) for i, e in enumerate(events[: end + 1] + late)]
    with session_scope() as s:  # the session ends: its window closes 1 s from now (ingestion clock)
        batch_mod.apply_batch(s, "g", _classify(msgs[: end + 1]), projector_from_settings(cs))
    window_closed_at = time.monotonic() + cs.signal_window_s

    b_waiting, swept = threading.Event(), threading.Event()
    real_lock_offsets = batch_mod.lock_offsets

    def lock_offsets_then_wait(session, group_id, first):
        if threading.current_thread().name == "member-b" and not b_waiting.is_set():
            b_waiting.set()  # B's transaction (and its now()) began before the close
            swept.wait(10)
        return real_lock_offsets(session, group_id, first)

    monkeypatch.setattr(batch_mod, "lock_offsets", lock_offsets_then_wait)
    member = IngestConsumer(bootstrap="127.0.0.1:9", topic="t", group_id="g", client_id="mb", settings=cs)
    caplog.set_level(logging.INFO, logger="app.core.retry")
    errors: list[BaseException] = []
    tb = threading.Thread(target=_guarded(lambda: member.process(msgs[end + 1 :]), errors), name="member-b")
    try:
        tb.start()
        assert b_waiting.wait(30)
        time.sleep(max(0.0, window_closed_at - time.monotonic()) + 0.2)
        assert finalize_due(projector_from_settings(cs), grace_s=0.0) == {"window": 1}
        swept.set()
        tb.join(60)
    finally:
        swept.set()
        member.close()
    assert not errors, errors
    assert "was finalized by its window" in caplog.text  # the race did happen, and B was redone
    assert member.stats.stored == len(late)
    with psycopg.connect(db) as conn:
        status, by, late_ids = conn.execute("SELECT status, finalized_by, late_event_ids FROM trajectory").fetchone()
    assert (status, by) == ("finalized", "window")
    assert sorted(late_ids) == sorted(e.event_id for e in late)
    _every_event_once(db, len(msgs))
    _live_equals_replay(db, cs)

"""Sessions whose events arrive on two partitions at once (a producer that does not key by session,
or the topic's partition count raised while sessions are live), applied by two group members in
concurrent batch transactions: every event is stored once, nothing is lost, and the trajectories
equal a replay of ``event_log`` (which folds by ``seq``), whatever the interleaving."""

from __future__ import annotations

import logging
import threading
from collections import defaultdict

import psycopg
import pytest

from consumers.testing import generate_stream, kafka_record

pytestmark = pytest.mark.integration


def _messages_by_partition(events, split_at: float):
    """Each session's first ``split_at`` share of events on partition 0, the rest on partition 1."""
    from consumers.deadletter import Message

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
    from consumers.deadletter import classify

    return [classify(m, 1 << 20) for m in msgs]


def _live_equals_replay(db) -> None:
    from app.core.db import session_scope
    from consumers.ingest import projector_from_settings
    from consumers.replay import compare_projections, drop_schema, dump_projection, replay

    with session_scope() as s:
        live = dump_projection(s)
    replay(projector_from_settings(), grace_s=0.0, schema="split_replay")
    try:
        with session_scope() as s:
            rebuilt = dump_projection(s, "split_replay")
        assert compare_projections(live, rebuilt) == []
    finally:
        with session_scope() as s:
            drop_schema(s, "split_replay")


def _race(monkeypatch, b_apply, a_apply) -> None:
    """Run ``b_apply`` in thread member-b, which pauses (up to 2 s) right after storing its events
    in ``event_log``; start ``a_apply`` in thread member-a during that pause; wait for both.

    Raises:
        AssertionError: either raised, or B never stored its events.
    """
    import consumers.batch as batch_mod

    b_stored, a_done = threading.Event(), threading.Event()
    real_append = batch_mod.append_events

    def append_then_pause(session, rows, method="copy"):
        out = real_append(session, rows, method)
        if threading.current_thread().name == "member-b" and not b_stored.is_set():
            b_stored.set()
            a_done.wait(2.0)  # A gets every chance to overtake B here
        return out

    monkeypatch.setattr(batch_mod, "append_events", append_then_pause)
    errors: list[BaseException] = []

    def guarded(fn, done: threading.Event | None = None):
        def run() -> None:
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 -- reported below
                errors.append(exc)
            finally:
                if done is not None:
                    done.set()
        return run

    tb = threading.Thread(target=guarded(b_apply), name="member-b")
    tb.start()
    assert b_stored.wait(30)
    ta = threading.Thread(target=guarded(a_apply, a_done), name="member-a")
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


def _apply(msgs):
    from app.core.db import session_scope
    from consumers.batch import apply_batch
    from consumers.ingest import projector_from_settings

    def run() -> None:
        with session_scope() as s:
            apply_batch(s, "g", _classify(msgs), projector_from_settings())
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
    members = {p: IngestConsumer(bootstrap="127.0.0.1:9", topic="t", group_id="g", client_id=f"m{p}")
               for p in parts}
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

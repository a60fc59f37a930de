"""Right to erasure and privacy mode, through the real broker and consumer."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest

from app.models.checkpoints import CheckpointStatus
from consumers.testing import generate_session, kafka_record, produce
from consumers.trajectory_state import trajectory_id_for
from producers.events.types import UserErasureRequested, UserErasureRequestedEvent
from tests.fixtures.broker import read_topic

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test: the session's broker keeps every group's membership, and a group
    whose members were SIGKILLed by an earlier test must not slow this test's join."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


T0 = datetime.now(UTC) - timedelta(hours=1)


def _sessions(rng, user: str, n: int, start: datetime, prefix: str, **kw):
    return [
        e
        for i in range(n)
        for e in generate_session(
            rng, session_id=f"{prefix}-{user}-{i}", user_id=user, start=start + timedelta(seconds=i), **kw
        )
    ]


def _consume():
    from consumers.ingest import IngestConsumer

    return IngestConsumer().run(idle_exit_s=1.5)


def _mined_task(session_id: str):
    """An ``eval_task`` row as ``evals.mined`` stores one from ``session_id``'s trajectory: it holds the
    session's request text."""
    from app.models import EvalTask

    return EvalTask(
        task_id=f"mined-{session_id}",
        suite="mined",
        source_session_id=session_id,
        source_trajectory_id=trajectory_id_for(session_id),
        content_hash=f"hash-{session_id}",
        spec={"request": f"the request of {session_id}"},
    )


def test_erasure_removes_the_users_rows_and_flags_checkpoints(db, topics, kafka_bootstrap):
    rng = np.random.default_rng(3)
    alice = _sessions(rng, "u-alice", 6, T0, "a")
    bob = _sessions(rng, "u-bob", 6, T0, "b")
    records = [kafka_record(e) for e in alice + bob]
    records.append((b"a-u-alice-0", b'{"user_id": "u-alice", "type": "nope"}', []))  # a dead letter of alice's
    records.append((b"a-u-alice-1", b'{"user_id": "u-alice", "type": "session.st', []))  # hers, not JSON
    records.append((b"b-u-bob-0", b'{"user_id": "u-bob", "type": "nope", "to": "u-alice"}', []))  # bob's
    produce(kafka_bootstrap, topics["interactions"], records)
    _consume()

    from app.core.db import session_scope
    from app.models import CheckpointTrajectory
    from app.repositories.checkpoints import add_checkpoint

    with session_scope() as s:  # what the trainer records from its manifests
        add_checkpoint(s, checkpoint_id="base", path="/b", status=CheckpointStatus.PRODUCTION)
        add_checkpoint(s, checkpoint_id="ck-1", path="/c1", parent_id="base", generation=1)
        add_checkpoint(s, checkpoint_id="ck-2", path="/c2", parent_id="base", generation=1)
        s.add_all(
            [
                CheckpointTrajectory(
                    checkpoint_id="ck-1", trajectory_id=trajectory_id_for("a-u-alice-0"), user_id="u-alice"
                ),
                CheckpointTrajectory(
                    checkpoint_id="ck-1", trajectory_id=trajectory_id_for("b-u-bob-0"), user_id="u-bob"
                ),
                CheckpointTrajectory(
                    checkpoint_id="ck-2", trajectory_id=trajectory_id_for("b-u-bob-1"), user_id="u-bob"
                ),
            ]
        )
        s.add_all([_mined_task(sid) for sid in ("a-u-alice-0", "b-u-bob-0")])  # what `eval mine` stores
    with psycopg.connect(db, autocommit=True) as conn:
        assert conn.execute("SELECT count(*) FROM trajectory WHERE user_id = 'u-alice'").fetchone()[0] == 6
        assert sorted(conn.execute("SELECT reason, user_id FROM dead_letter").fetchall(), key=str) == [
            ("bad_json", None),
            ("unknown_type", "u-alice"),
            ("unknown_type", "u-bob"),
        ]
        with pytest.raises(psycopg.errors.RaiseException, match="append-only"):
            conn.execute("DELETE FROM event_log WHERE user_id = 'u-alice'")

    request = UserErasureRequestedEvent(
        session_id="erasure-1",
        user_id="u-alice",
        payload=UserErasureRequested(request_id="req-1", reason="GDPR art. 17"),
    )
    # After the request: a straggler of an old session (occurred before it) on another key, and a new session.
    straggler = generate_session(rng, session_id="a-u-alice-late", user_id="u-alice", start=T0)[:3]
    after = generate_session(
        rng, session_id="a-u-alice-new", user_id="u-alice", start=datetime.now(UTC) + timedelta(seconds=5)
    )
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(request)])
    # Her malformed records after the request (its key: the same partition, so surely after it in the
    # stream): of an old session, and of one that does not say when (both covered by the erasure:
    # stored without their bytes), and of her new session (kept whole).
    later = [
        (
            b"erasure-1",
            b'{"user_id": "u-alice", "session_id": "a-u-alice-0", "occurred_at": "'
            + T0.isoformat().encode()
            + b'", "type": "nope", "text": "her secret"}',
            [],
        ),
        (b"erasure-1", b'{"user_id": "u-alice", "type": "nope", "text": "her secret"}', []),
        (
            b"erasure-1",
            b'{"user_id": "u-alice", "session_id": "a-u-alice-new", "occurred_at": "'
            + (datetime.now(UTC) + timedelta(seconds=30)).isoformat().encode()
            + b'", "type": "nope"}',
            [],
        ),
    ]
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in straggler + after] + later)
    stats = _consume()
    assert stats.dead_letters == {"unknown_type": 3}

    with psycopg.connect(db) as conn:
        q = lambda sql, *p: conn.execute(sql, p).fetchall()  # noqa: E731
        sessions = {r[0] for r in q("SELECT DISTINCT session_id FROM event_log WHERE user_id = 'u-alice'")}
        assert sessions == {"a-u-alice-new"}  # old events gone, the straggler dropped, new data kept
        assert q("SELECT count(*) FROM event_log WHERE session_id = 'erasure-1'") == [(0,)]  # stored minimally
        assert q("SELECT session_id FROM trajectory WHERE user_id = 'u-alice'") == [("a-u-alice-new",)]
        assert q(
            "SELECT count(*) FROM trajectory_segment s JOIN trajectory t ON t.id = s.trajectory_id "
            "WHERE t.user_id = 'u-alice' AND t.session_id <> 'a-u-alice-new'"
        ) == [(0,)]
        assert q("SELECT count(*) FROM reward_label WHERE trajectory_id = %s", trajectory_id_for("a-u-alice-0")) == [
            (0,)
        ]
        # alice's two before the request are gone; bob's merely names her; her later ones are kept as above
        kept = q("SELECT user_id, key, raw IS NOT NULL, headers IS NOT NULL, left(detail, 18) FROM dead_letter")
        assert sorted(kept, key=str) == [
            ("u-alice", None, False, False, "raw bytes not kept"),
            ("u-alice", None, False, False, "raw bytes not kept"),
            ("u-alice", b"erasure-1", True, True, "unknown or missing"),
            ("u-bob", b"b-u-bob-0", True, True, "unknown or missing"),
        ]
        assert q("SELECT count(*) FROM dead_letter WHERE position('her secret' in convert_from(raw, 'UTF8')) > 0") == [
            (0,)
        ]
    # The DLQ topic got what the table holds: her two before the request whole (published before it),
    # the two it covers without key or bytes, her new session's and bob's whole.
    dlq = read_topic(kafka_bootstrap, topics["dlq"])
    assert not [m for m in dlq if b"her secret" in m.value or any(b"her secret" in v for _, v in m.headers)]
    redacted = [m for m in dlq if dict(m.headers).get("dlq-redacted") == b"erasure"]
    assert [(m.key, m.value) for m in redacted] == [(None, b"")] * 2
    assert sorted(m.key for m in dlq if m not in redacted) == [
        b"a-u-alice-0",
        b"a-u-alice-1",
        b"b-u-bob-0",
        b"erasure-1",
    ]
    with psycopg.connect(db) as conn:
        q = lambda sql, *p: conn.execute(sql, p).fetchall()  # noqa: E731
        (req,) = q(
            "SELECT user_id, events_deleted, trajectories_deleted, checkpoints_flagged, dead_letters_deleted, "
            "cardinality(trajectory_ids), requested_at, eval_tasks_deleted FROM erasure_request "
            "WHERE request_id = 'req-1'"
        )
        # the straggler is erased with the rest if its partition delivered it before the request,
        # dropped at ingest if after
        straggled = req[2] - 6
        assert straggled in (0, 1) and req[1] == len(alice) + 3 * straggled
        assert req[:1] + req[3:6] == ("u-alice", ["ck-1"], 2, 6 + straggled)
        assert req[6] == request.occurred_at
        assert req[7] == 1 and q("SELECT source_session_id FROM eval_task") == [("b-u-bob-0",)]
        flags = dict(
            (r[0], (r[1], r[2] is not None))
            for r in q("SELECT id, trained_on_erased, erasure_flagged_at FROM checkpoint")
        )
        assert flags == {"base": (False, False), "ck-1": (True, True), "ck-2": (False, False)}
        assert q("SELECT count(*) FROM event_log WHERE user_id = 'u-bob'") == [(len(bob),)]
        assert q("SELECT count(*) FROM trajectory WHERE user_id = 'u-bob'") == [(6,)]

    # the same request again is applied again, up to its own time (now): what alice stored after the
    # first one goes too; the projections still replay to the same rows
    from typer.testing import CliRunner

    from ops.cli import app

    out = CliRunner().invoke(app, ["erase", "u-alice", "--request-id", "req-1"])
    assert out.exit_code == 0 and '"repeated": true' in out.output, out.output
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log WHERE user_id = 'u-alice'").fetchone() == (0,)
    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 0 and '"identical": true' in out.output, out.output


def test_privacy_mode_sessions_leave_only_a_tombstone(db, topics, kafka_bootstrap):
    rng = np.random.default_rng(4)
    private = generate_session(rng, session_id="p-1", user_id="u-p", start=T0, privacy_mode=True)
    # a producer that flags only the first event: the whole session stays private
    mixed = generate_session(rng, session_id="p-2", user_id="u-p", start=T0)
    mixed[0] = mixed[0].model_copy(update={"privacy_mode": True})
    public = generate_session(rng, session_id="o-1", user_id="u-p", start=T0)
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in private + mixed + public])
    stats = _consume()  # the run's totals (what `flywheel consume` prints) count the dropped events
    assert (stats.stored, stats.privacy_dropped, stats.erased_dropped) == (len(public), len(private + mixed), 0)
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT DISTINCT session_id FROM event_log").fetchall() == [("o-1",)]
        assert conn.execute("SELECT session_id FROM trajectory").fetchall() == [("o-1",)]
        tomb = dict(conn.execute("SELECT session_id, events_dropped FROM privacy_tombstone").fetchall())
    assert tomb == {"p-1": len(private), "p-2": len(mixed)}


def test_a_session_flagged_private_part_way_is_deleted_whole(db, topics, kafka_bootstrap):
    """Privacy turned on mid-session: the events stored before the flag (by an earlier batch, or
    earlier in the same batch) go with the trajectory, and the tombstone counts them."""
    rng = np.random.default_rng(5)
    earlier = generate_session(rng, session_id="p-late", user_id="u-p", start=T0)
    same_batch = generate_session(rng, session_id="p-same", user_id="u-p", start=T0)
    public = generate_session(rng, session_id="o-2", user_id="u-p", start=T0)
    cut = len(earlier) // 2
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in earlier[:cut] + public])
    _consume()

    from app.core.db import session_scope
    from app.models import CheckpointTrajectory
    from app.repositories.checkpoints import add_checkpoint

    with session_scope() as s:  # a checkpoint trained on the part stored before the flag
        add_checkpoint(s, checkpoint_id="ck-p", path="/p", parent_id=None, generation=1)
        s.add(CheckpointTrajectory(checkpoint_id="ck-p", trajectory_id=trajectory_id_for("p-late"), user_id="u-p"))
        s.add_all([_mined_task("p-late"), _mined_task("o-2")])
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log WHERE session_id = 'p-late'").fetchone() == (cut,)
    flag = lambda events: [e.model_copy(update={"privacy_mode": True}) for e in events]  # noqa: E731
    rest = flag(earlier[cut : cut + 1]) + earlier[cut + 1 :]
    mixed = same_batch[:3] + flag(same_batch[3:4]) + same_batch[4:]
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in rest + mixed])
    _consume()
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT DISTINCT session_id FROM event_log").fetchall() == [("o-2",)]
        assert conn.execute("SELECT session_id FROM trajectory").fetchall() == [("o-2",)]
        tomb = dict(conn.execute("SELECT session_id, events_dropped FROM privacy_tombstone").fetchall())
        flagged = conn.execute("SELECT trained_on_erased FROM checkpoint WHERE id = 'ck-p'").fetchone()
    assert tomb == {"p-late": len(earlier), "p-same": len(same_batch)}
    assert flagged == (True,)
    with psycopg.connect(db) as conn:  # the task mined from it went with it
        assert conn.execute("SELECT source_session_id FROM eval_task").fetchall() == [("o-2",)]

    from typer.testing import CliRunner

    from ops.cli import app

    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 0 and '"identical": true' in out.output, out.output


def _malformed(event, secret: str, **top) -> tuple:
    """The producer's record of ``event`` with a payload field the contract forbids (a dead letter
    whose bytes still claim the event's user and session) carrying ``secret``."""
    key, value, headers = kafka_record(event)
    obj = json.loads(value)
    obj["payload"]["secret"] = secret
    return key, json.dumps({**obj, **top}).encode(), headers


def test_a_private_sessions_dead_letters_keep_no_bytes(db, topics, kafka_bootstrap):
    """A privacy-mode session's malformed records keep their place and reason, not their bytes:
    stored before the session's flag (then stripped by it), after it, or claiming the flag themselves;
    the DLQ topic gets those after the flag without bytes. Another session's are kept whole. A
    malformed record that claims the flag makes its session private whole, as a valid flag would:
    its valid events, stored by an earlier batch or around it in this one, go too."""
    rng = np.random.default_rng(9)
    private = generate_session(rng, session_id="p-dl", user_id="u-q", start=T0)
    claimed = generate_session(rng, session_id="p-claim", user_id="u-q", start=T0)
    public = generate_session(rng, session_id="o-3", user_id="u-q", start=T0)
    produce(
        kafka_bootstrap,
        topics["interactions"],
        [kafka_record(e) for e in private[:2]]
        + [_malformed(private[2], "private code 1")]
        + [kafka_record(e) for e in claimed[:2]],
    )
    _consume()
    with psycopg.connect(db) as conn:  # before the flag it is an ordinary session's dead letter
        assert conn.execute("SELECT session_id, redacted, raw IS NOT NULL FROM dead_letter").fetchall() == [
            ("p-dl", None, True)
        ]
        assert conn.execute("SELECT count(*) FROM event_log WHERE session_id = 'p-claim'").fetchone() == (2,)
    flagged = [e.model_copy(update={"privacy_mode": True}) for e in private[3:4]]
    produce(
        kafka_bootstrap,
        topics["interactions"],
        [kafka_record(e) for e in flagged]
        + [_malformed(private[4], "private code 2")]
        + [kafka_record(claimed[2]), _malformed(claimed[3], "private code 3", privacy_mode=True)]
        + [kafka_record(e) for e in claimed[4:]]
        + [kafka_record(public[0]), _malformed(public[1], "public text")]
        + [kafka_record(e) for e in public[2:]],
    )
    _consume()
    with psycopg.connect(db) as conn:
        rows = conn.execute(
            "SELECT session_id, redacted, key IS NULL AND raw IS NULL AND headers IS NULL, detail "
            'FROM dead_letter ORDER BY session_id DESC, partition, "offset"'
        ).fetchall()
        leaked = conn.execute(
            "SELECT count(*) FROM dead_letter WHERE position('private code' in convert_from(raw, 'UTF8')) > 0"
        ).fetchone()
        stored = dict(conn.execute("SELECT session_id, count(*) FROM event_log GROUP BY session_id").fetchall())
        trajectories = conn.execute("SELECT session_id FROM trajectory").fetchall()
        tomb = dict(conn.execute("SELECT session_id, events_dropped FROM privacy_tombstone").fetchall())
    assert stored == {"o-3": len(public) - 1} and trajectories == [("o-3",)]
    assert tomb == {"p-dl": 3, "p-claim": len(claimed) - 1}  # events (not dead letters) stored or dropped
    stripped = "raw bytes not kept: the session is in privacy mode; "
    assert [(sid, why, gone, detail.startswith(stripped)) for sid, why, gone, detail in rows] == [
        ("p-dl", "privacy", True, True),
        ("p-dl", "privacy", True, True),  # before the flag, after it
        ("p-claim", "privacy", True, True),  # claims the flag
        ("o-3", None, False, False),
    ]  # does not
    assert all("secret" in detail for *_, detail in rows)  # the reason is kept
    assert leaked == (0,)
    dlq = read_topic(kafka_bootstrap, topics["dlq"])
    # the first was published whole by its batch, before anything said the session was private
    assert [b"private code 1" in m.value for m in dlq].count(True) == 1
    assert not [m for m in dlq if b"private code 2" in m.value or b"private code 3" in m.value]
    assert [(m.key, m.value) for m in dlq if dict(m.headers).get("dlq-redacted") == b"privacy"] == [(None, b"")] * 2

    from typer.testing import CliRunner

    from ops.cli import app

    out = CliRunner().invoke(app, ["replay", "--verify"])
    assert out.exit_code == 0 and '"identical": true' in out.output, out.output


def test_an_erasure_finds_dead_letters_through_indexes(db):
    """The erasure's dead-letter delete has an index path (the user's attributed rows, then only the
    unattributed ones are searched byte-wise): it need not scan ``dead_letter`` while it holds the
    projection lock exclusively."""
    from consumers.erasure import DELETE_DEAD_LETTERS

    with psycopg.connect(db) as conn:
        conn.execute("SET enable_seqscan = off")  # a seq scan is then chosen only if nothing else exists
        plan = "\n".join(
            r[0] for r in conn.execute("EXPLAIN " + DELETE_DEAD_LETTERS, {"user_id": "u", "quoted": b'"u"'})
        )
    assert "Seq Scan" not in plan and "ix_dead_letter_user_id" in plan and "ix_dead_letter_unattributed" in plan, plan

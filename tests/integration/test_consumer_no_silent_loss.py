"""No silent loss, through the real broker and Postgres: a session missing events is never trained
on, a repeated erasure erases what came since, a re-serialized re-send is a duplicate, an
oversized record is refused by the SDK and bounded in ``dead_letter``."""

from __future__ import annotations

import hashlib
import json
import time
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest

from app.models.checkpoints import CheckpointStatus
from consumers.testing import generate_session, kafka_record, produce
from consumers.trajectory_state import trajectory_id_for
from producers.events.codec import encode_event
from producers.events.types import UserErasureRequested, UserErasureRequestedEvent

pytestmark = pytest.mark.integration

T0 = datetime.now(UTC) - timedelta(hours=1)


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


def _consume(**overrides):
    from consumers.ingest import IngestConsumer
    from consumers.settings import get_consumer_settings

    settings = get_consumer_settings().model_copy(update=overrides)
    return IngestConsumer(settings=settings).run(idle_exit_s=1.5)


def _numbered(events):
    """The session's events as the producer SDK sends them: ``seq`` 0, 1, 2, ..."""
    return [e.model_copy(update={"seq": i}) for i, e in enumerate(events)]


def _q(db: str, sql: str, params=()):
    with psycopg.connect(db) as conn:
        return conn.execute(sql, params).fetchall()


def test_a_session_missing_events_is_held_then_marked_incomplete_and_never_trained_on(db, topics, kafka_bootstrap):
    from app.core.db import session_scope
    from app.repositories.checkpoints import add_checkpoint
    from consumers.finalize import finalize_due
    from consumers.ingest import projector_from_settings
    from consumers.settings import get_consumer_settings
    from trainer.config import DataConfig
    from trainer.selection import select_cycle_data

    rng = np.random.default_rng(44)
    whole = _numbered(generate_session(rng, session_id="s-whole", user_id="u-1", start=T0))
    headless = _numbered(generate_session(rng, session_id="s-headless", user_id="u-1", start=T0))[2:]
    gapped = _numbered(generate_session(rng, session_id="s-gap", user_id="u-1", start=T0))
    gapped = gapped[:3] + gapped[4:]  # seq 3 lost
    legacy = generate_session(rng, session_id="s-legacy", user_id="u-1", start=T0)[1:]  # no seq, no start
    assert headless[0].type != "session.started" and {e.type for e in whole[:2]} == {
        "session.started",
        "agent.requested",
    }
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in whole + headless + gapped + legacy])
    window = 2.0
    stats = _consume(signal_window_s=window, finalize_interval_s=3600)
    assert stats.stored == len(whole) + len(headless) + len(gapped) + len(legacy)
    status = dict(_q(db, "SELECT session_id, status FROM trajectory"))
    # every signal arrived for all four: only the whole one is finalized by them, the others are held
    assert status == {
        "s-whole": "finalized",
        "s-headless": "provisional",
        "s-gap": "provisional",
        "s-legacy": "provisional",
    }

    time.sleep(window + 0.5)
    cs = get_consumer_settings()
    finalize_due(projector_from_settings(cs.model_copy(update={"signal_window_s": window})), 0.0)
    rows = {
        r[0]: r[1:]
        for r in _q(db, "SELECT session_id, status, finalized_by, incomplete_reason, producer_seq_max FROM trajectory")
    }
    assert rows["s-whole"] == ("finalized", "signals", None, len(whole) - 1)
    assert rows["s-headless"][:3] == (
        "finalized",
        "window",
        f"no session.started; 2 of producer seq 0..{len(headless) + 1} missing",
    )
    assert rows["s-gap"][:3] == ("finalized", "window", f"1 of producer seq 0..{len(gapped)} missing")
    assert rows["s-legacy"][:3] == ("finalized", "window", "no session.started")
    labelled = {
        r[0] for r in _q(db, "SELECT t.session_id FROM reward_label l JOIN trajectory t ON t.id = l.trajectory_id")
    }
    assert labelled == set(rows)  # labelled like any other: the reason, not a missing label, keeps them out

    with session_scope() as s:
        parent = add_checkpoint(s, checkpoint_id="base", path="/b", status=CheckpointStatus.PRODUCTION)
        s.flush()
        data = select_cycle_data(s, DataConfig(max_age_hours=24), parent)
    ids = dict(_q(db, "SELECT id::text, session_id FROM trajectory"))
    excluded = {ids[k]: v for k, v in data.excluded.items()}
    assert [t.session_id for t in data.used] == ["s-whole"]
    assert excluded == {"s-headless": "incomplete", "s-gap": "incomplete", "s-legacy": "incomplete"}


def test_a_repeated_erasure_request_erases_what_the_user_stored_since(db, topics, kafka_bootstrap, caplog):
    rng = np.random.default_rng(45)
    before = generate_session(rng, session_id="s-old", user_id="u-back", start=T0)
    request = UserErasureRequestedEvent(
        session_id="erasure",
        user_id="u-back",
        occurred_at=max(e.occurred_at for e in before) + timedelta(minutes=1),
        payload=UserErasureRequested(request_id="req-7"),
    )
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in before + [request]])
    _consume()
    assert _q(db, "SELECT count(*) FROM event_log WHERE user_id = 'u-back'") == [(0,)]

    after = generate_session(
        rng, session_id="s-new", user_id="u-back", start=request.occurred_at + timedelta(minutes=1)
    )
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in after])
    _consume()
    assert _q(db, "SELECT count(*) FROM event_log WHERE user_id = 'u-back'") == [(len(after),)]

    later = max(e.occurred_at for e in after) + timedelta(minutes=1)
    again = request.model_copy(update={"event_id": uuid.uuid4(), "occurred_at": later})
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(again)])
    with caplog.at_level("INFO", logger="consumers.erasure"):
        stats = _consume()
    assert stats.erasures == 1
    assert _q(db, "SELECT count(*) FROM event_log WHERE user_id = 'u-back'") == [(0,)]
    assert _q(db, "SELECT count(*) FROM trajectory WHERE user_id = 'u-back'") == [(0,)]
    [(events, requested_at, tids)] = _q(
        db,
        "SELECT events_deleted, requested_at, trajectory_ids FROM erasure_request "
        "WHERE user_id = 'u-back' AND request_id = 'req-7'",
    )
    # the first application deleted s-old, or s-old's partition came later and its events were dropped
    assert events >= len(after) and requested_at == again.occurred_at and trajectory_id_for("s-new") in tids
    assert any("applied again" in r.getMessage() and f"{len(after)} events" in r.getMessage() for r in caplog.records)


def test_a_resend_differing_only_in_json_spacing_is_a_duplicate(db, topics, kafka_bootstrap):
    rng = np.random.default_rng(46)
    events = generate_session(rng, session_id="s-dup", user_id="u-2", start=T0)
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events])
    _consume()
    turn = next(e for e in events if e.type == "model.responded")
    key, _, headers = kafka_record(turn)
    spaced = json.dumps(json.loads(encode_event(turn)), indent=2).encode()
    changed = json.loads(encode_event(turn))
    changed["payload"]["latency_s"] += 1.0
    produce(
        kafka_bootstrap, topics["interactions"], [(key, spaced, headers), (key, json.dumps(changed).encode(), headers)]
    )
    stats = _consume()
    assert stats.duplicates == 1 and dict(stats.dead_letters) == {"conflicting_duplicate": 1}
    [(detail,)] = _q(db, "SELECT detail FROM dead_letter")
    assert "payload" in detail


def test_an_oversized_record_is_refused_by_the_sdk_and_bounded_in_storage(db, topics, kafka_bootstrap, tmp_path):
    from consumers.settings import get_consumer_settings
    from producers.events.types import FollowupSent, FollowupSentEvent
    from producers.producer import EventProducer

    limit = get_consumer_settings().dead_letter_head_bytes
    big = FollowupSentEvent(session_id="s-big", user_id="u-3", payload=FollowupSent(text="x" * 90_000))
    producer = EventProducer(kafka_bootstrap, topics["interactions"], spool_dir=tmp_path, max_event_bytes=65_536)
    try:
        with pytest.raises(ValueError, match="over the limit of 65536 bytes"):
            producer.emit(big)
    finally:
        producer.close()

    raw = b'{"user_id": "u-3", "blob": "' + b"y" * (20 * 1_048_576) + b'"}'
    small = b'{"user_id": "u-3", "type": "nope"}'
    _produce_large(kafka_bootstrap, topics["interactions"], [(b"s-big", raw), (b"s-big", small)])
    stats = _consume()
    assert dict(stats.dead_letters) == {"oversized": 1, "unknown_type": 1}
    rows = _q(
        db,
        'SELECT reason, length(raw), raw_size, raw_sha256, substring(raw from 1 for 16) FROM dead_letter ORDER BY "offset"',
    )
    assert rows[0][:4] == ("oversized", limit, len(raw), hashlib.sha256(raw).digest())
    assert bytes(rows[0][4]) == raw[:16]
    assert rows[1][:4] == ("unknown_type", len(small), len(small), hashlib.sha256(small).digest())


def _produce_large(bootstrap: str, topic: str, records) -> None:
    """Send (key, value) records of up to 32 MiB, bypassing the SDK's limit (a misbehaving producer)."""
    from kafka import KafkaProducer

    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", max_request_size=32 * 1_048_576)
    try:
        for f in [producer.send(topic, key=k, value=v) for k, v in records]:
            f.get(timeout=60)
    finally:
        producer.close()

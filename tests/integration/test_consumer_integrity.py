"""No poisoned training data, no silent skip (real tansu broker, real Postgres): impossible values end
in ``dead_letter`` with a reason and a detail naming the field; an erasure request id reused for
another user still erases that user; an ``event_id`` re-sent with a different body is a
``conflicting_duplicate`` dead letter while the stored event stays."""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta

import numpy as np
import psycopg
import pytest

from consumers.testing import generate_session, kafka_record, produce
from producers.events import encode_event
from producers.events.types import UserErasureRequested, UserErasureRequestedEvent
from tests.fixtures.broker import read_topic

pytestmark = pytest.mark.integration

T0 = datetime.now(UTC) - timedelta(hours=1)


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


def _consume():
    from consumers.ingest import IngestConsumer

    return IngestConsumer().run(idle_exit_s=1.5)


def _session(session_id: str, user: str = "u-1", start: datetime = T0):
    return generate_session(
        np.random.default_rng(abs(hash(session_id)) % 2**32), session_id=session_id, user_id=user, start=start
    )


def _f32(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<f4").tobytes()).decode()


def _i32(values) -> str:
    return base64.b64encode(np.asarray(values, dtype="<i4").tobytes()).decode()


def _mutations(turn: dict) -> list[tuple[str, dict]]:
    """(field the dead letter must name, event) for each impossible value of issue 34."""
    n = len(base64.b64decode(turn["payload"]["completion_token_ids"])) // 4
    out = []

    def with_payload(field: str, value, name: str | None = None) -> None:
        e = json.loads(json.dumps(turn))
        e["event_id"], e["payload"][field] = str(uuid.uuid4()), value
        out.append((name or field, e))

    for bad in (5.0, float("nan"), float("inf"), float("-inf")):
        lp = [-0.5] * n
        lp[n // 2] = bad
        with_payload("completion_logprobs", _f32(lp))
    for bad in (-1, 10**9, 2**31 - 1):
        ids = [7] * n
        ids[0] = bad
        with_payload("completion_token_ids", _i32(ids))
    with_payload("prompt_token_ids", _i32([3, -5, 4]))
    with_payload("turn_index", 10**30)
    with_payload("latency_s", 1e308)
    e = json.loads(json.dumps(turn))
    e["event_id"], e["payload"]["completion_token_ids"], e["payload"]["completion_logprobs"] = str(uuid.uuid4()), "", ""
    out.append(("completion_token_ids", e))
    e = json.loads(json.dumps(turn))
    e["event_id"], e["payload"]["vocab_size"] = str(uuid.uuid4()), 100  # ids of up to 49151 in a 100-token vocab
    out.append(("completion_token_ids", e))
    for year in (9999, 1):
        e = json.loads(json.dumps(turn))
        e["event_id"], e["occurred_at"] = str(uuid.uuid4()), f"{year:04d}-06-01T00:00:00Z"
        out.append(("occurred_at", e))
    return out


def test_impossible_values_are_dead_letters_naming_the_field_and_never_stored(db, topics, kafka_bootstrap):
    good = _session("s-good")
    turn = json.loads(encode_event(next(e for e in good if e.type == "model.responded")))
    bad = _mutations(turn)
    records = [kafka_record(e) for e in good] + [(b"s-bad", json.dumps(e, allow_nan=True).encode(), []) for _, e in bad]
    produce(kafka_bootstrap, topics["interactions"], records)
    stats = _consume()
    assert stats.stored == len(good)
    assert sum(stats.dead_letters.values()) == len(bad)
    with psycopg.connect(db) as conn:
        rows = conn.execute('SELECT "offset", reason, detail FROM dead_letter ORDER BY "offset"').fetchall()
        ids = {str(r[0]) for r in conn.execute("SELECT event_id FROM event_log")}
    assert not ids & {e["event_id"] for _, e in bad}
    assert len(rows) == len(bad)
    for (field, _event), (_, reason, detail) in zip(bad, rows):
        assert reason in {"implausible", "validation"}, (field, reason, detail)
        assert field in detail, (field, detail)
    # the plausibility rules themselves, not a schema accident, refused the arrays and the times
    assert [r for (f, _), (_, r, _) in zip(bad, rows) if f in ("completion_logprobs", "occurred_at")] == [
        "implausible"
    ] * 6
    dlq = read_topic(kafka_bootstrap, topics["dlq"])
    assert len(dlq) == len(bad)


def test_a_reused_erasure_request_id_for_another_user_still_erases_that_user(db, topics, kafka_bootstrap):
    a, b = _session("s-a", user="u-a"), _session("s-b", user="u-b")
    now = datetime.now(UTC)
    requests = [
        UserErasureRequestedEvent(
            session_id="erasure", user_id=user, occurred_at=now, payload=UserErasureRequested(request_id="req-shared")
        )
        for user in ("u-a", "u-b")
    ]
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in a + b + requests[:1]])
    _consume()
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(requests[1]), kafka_record(requests[1])])
    stats = _consume()
    assert stats.erasures == 2  # the redelivered copy counts as applied, and deletes nothing more
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM event_log").fetchone()[0] == 0
        assert conn.execute("SELECT count(*) FROM trajectory").fetchone()[0] == 0
        got = conn.execute("SELECT user_id, events_deleted FROM erasure_request ORDER BY user_id").fetchall()
    assert got == [("u-a", len(a)), ("u-b", len(b))]

    out = subprocess.run(
        [sys.executable, "-m", "ops.cli", "erasures", "list"], capture_output=True, text=True, timeout=120, check=True
    ).stdout
    listed = {r["user_id"]: r for r in map(json.loads, out.splitlines())}
    assert listed["u-b"]["outcome"] == "erased" and listed["u-b"]["events_deleted"] == len(b)
    assert listed["u-b"]["request_id_shared_with"] == ["u-a"] and listed["u-a"]["request_id_shared_with"] == ["u-b"]


def test_a_conflicting_duplicate_is_a_dead_letter_and_the_stored_event_stays(db, topics, kafka_bootstrap):
    from opentelemetry.sdk.metrics import MeterProvider
    from opentelemetry.sdk.metrics.export import InMemoryMetricReader

    from consumers.ingest import IngestConsumer
    from consumers.telemetry import ConsumerMetrics

    events = _session("s-dup")
    started = json.loads(encode_event(events[0]))
    forged = json.loads(json.dumps(started))
    forged["payload"]["task_id"] = "another-task"
    forged_same_batch = json.loads(json.dumps(json.loads(encode_event(events[1]))))
    forged_same_batch["session_id"] = "s-elsewhere"
    produce(
        kafka_bootstrap,
        topics["interactions"],
        [kafka_record(e) for e in events] + [(b"s-dup", json.dumps(forged_same_batch).encode(), [])],
    )
    consumer, reader = IngestConsumer(), InMemoryMetricReader()
    consumer.metrics = ConsumerMetrics("t", consumer.group_id, MeterProvider(metric_readers=[reader]).get_meter("t"))
    first = consumer.run(idle_exit_s=1.5)
    # later: the same bytes again (a producer retry: an ordinary duplicate) and a forged body
    produce(
        kafka_bootstrap, topics["interactions"], [kafka_record(events[0]), (b"s-dup", json.dumps(forged).encode(), [])]
    )
    second = IngestConsumer().run(idle_exit_s=1.5)

    assert first.stored == len(events) and first.dead_letters == {"conflicting_duplicate": 1}
    assert second.stored == 0 and second.duplicates == 1 and second.dead_letters == {"conflicting_duplicate": 1}
    with psycopg.connect(db) as conn:
        payload = conn.execute("SELECT payload FROM event_log WHERE event_id = %s", (started["event_id"],)).fetchone()[
            0
        ]
        rows = conn.execute("SELECT reason, detail FROM dead_letter ORDER BY id").fetchall()
    assert payload["task_id"] == started["payload"]["task_id"]
    assert [r[0] for r in rows] == ["conflicting_duplicate"] * 2
    assert "session_id" in rows[0][1] and "payload" in rows[1][1] and "the stored event stays" in rows[1][1]
    points = [
        p
        for rm in reader.get_metrics_data().resource_metrics
        for sm in rm.scope_metrics
        for m in sm.metrics
        if m.name == "flywheel.consumer.dead_letters"
        for p in m.data.data_points
    ]
    assert [(p.attributes["reason"], p.value) for p in points] == [("conflicting_duplicate", 1)]
    assert (
        sorted(dict(m.headers)["dlq-reason"] for m in read_topic(kafka_bootstrap, topics["dlq"]))
        == [b"conflicting_duplicate"] * 2
    )

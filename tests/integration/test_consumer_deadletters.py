"""Dead letters: hypothesis-generated malformed messages (byte garbage, truncations, JSON mutations)
interleaved with valid events all land in ``dead_letter`` and on the DLQ topic with their reason,
while every valid event around them is stored."""

from __future__ import annotations

import base64
import json
import random
import threading
import time
import uuid
from collections import Counter
from datetime import UTC, datetime

import numpy as np
import psycopg
import pytest
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

from consumers.classify import Message, classify
from consumers.deadletter import claim_of
from consumers.testing import generate_session, generate_stream, kafka_record, produce
from producers.events import EVENT_CLASSES, encode_event
from tests.fixtures.broker import read_topic


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    """A consumer group per test: the session's broker keeps every group's membership, and a group
    whose members were SIGKILLed by an earlier test must not slow this test's join."""
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


MAX_BYTES = 16_384
SENTINEL = {"x": [1]}  # no field of the contract accepts an object with this shape
_rng = np.random.default_rng(0)
BASES = [
    json.loads(encode_event(e))
    for e in generate_session(
        _rng, session_id="s-base", user_id="u-base", start=datetime.now(UTC), max_segments=2, max_turns=2
    )
    + generate_session(_rng, session_id="s-base2", user_id="u-base", start=datetime.now(UTC))
]
REQUIRED_ENVELOPE = ["type", "session_id", "user_id", "payload"]


def _required_payload(base: dict) -> list[str]:
    cls = EVENT_CLASSES[base["type"]]
    payload_cls = cls.model_fields["payload"].annotation
    return [n for n, f in payload_cls.model_fields.items() if f.is_required()]


def _strings(base: dict) -> list[tuple[str, ...]]:
    paths = [("session_id",), ("user_id",)]
    paths += [
        ("payload", k)
        for k, v in base["payload"].items()
        if isinstance(v, str) and not k.endswith(("_ids", "logprobs"))
    ]
    return paths


def _set(d: dict, path: tuple[str, ...], value) -> dict:
    d = json.loads(json.dumps(d))
    cur = d
    for k in path[:-1]:
        cur = cur[k]
    cur[path[-1]] = value
    return d


def _dumps(d) -> bytes:
    return json.dumps(d, allow_nan=True).encode()


@st.composite
def malformed(draw) -> tuple[bytes | None, set[str]]:
    """(raw bytes, reasons the consumer may give) for one malformed message."""
    base = draw(st.sampled_from(BASES))
    kind = draw(
        st.sampled_from(
            [
                "garbage",
                "truncate",
                "not_object",
                "drop",
                "wrong_type",
                "unknown_type",
                "schema_version",
                "extra_field",
                "nul",
                "surrogate",
                "non_finite",
                "oversized",
                "bad_tokens",
                "lengths",
            ]
        )
    )
    if kind == "garbage":
        return draw(st.one_of(st.none(), st.binary(max_size=300))), {"bad_json", "not_object", "unknown_type"}
    if kind == "truncate":
        raw = encode_event(EVENT_CLASSES[base["type"]].model_validate(base))
        return raw[: draw(st.integers(0, len(raw) - 1))], {"bad_json"}
    if kind == "not_object":
        value = draw(st.one_of(st.integers(), st.text(max_size=20), st.lists(st.integers(), max_size=3), st.none()))
        return _dumps(value), {"not_object"}
    if kind == "drop":
        if draw(st.booleans()) or not _required_payload(base):
            field = draw(st.sampled_from(REQUIRED_ENVELOPE))
            d = json.loads(json.dumps(base))
            del d[field]
            return _dumps(d), {"unknown_type"} if field == "type" else {"validation"}
        d = json.loads(json.dumps(base))
        del d["payload"][draw(st.sampled_from(_required_payload(base)))]
        return _dumps(d), {"validation"}
    if kind == "wrong_type":
        path = draw(st.sampled_from([(k,) for k in base if k != "payload"] + [("payload", k) for k in base["payload"]]))
        reasons = (
            {"unknown_type"}
            if path == ("type",)
            else {"schema_version"}
            if path == ("schema_version",)
            else {"validation"}
        )
        return _dumps(_set(base, path, SENTINEL)), reasons
    if kind == "unknown_type":
        t = draw(st.text(max_size=30).filter(lambda s: s not in EVENT_CLASSES))
        return _dumps(_set(base, ("type",), t)), {"unknown_type"}
    if kind == "schema_version":
        return _dumps(_set(base, ("schema_version",), draw(st.integers().filter(lambda v: v != 1)))), {"schema_version"}
    if kind == "extra_field":
        where = draw(st.sampled_from([(), ("payload",)]))
        name = draw(st.text(min_size=1, max_size=12).filter(lambda s: s not in base and s not in base["payload"]))
        return _dumps(_set(base, (*where, name), draw(st.integers()))), {"validation"}
    if kind in ("nul", "surrogate"):
        path = draw(st.sampled_from(_strings(base)))
        bad = "\x00" if kind == "nul" else "\ud800"
        return _dumps(_set(base, path, "ab" + bad)), {"unstorable", "validation", "bad_json"}
    if kind == "non_finite":
        fields = [k for k, v in base["payload"].items() if isinstance(v, float)] or ["latency_s"]
        value = draw(st.sampled_from([float("nan"), float("inf"), float("-inf")]))
        return _dumps(_set(base, ("payload", draw(st.sampled_from(fields))), value)), {
            "unstorable",
            "validation",
            "bad_json",
        }
    if kind == "oversized":
        return _dumps(_set(base, ("session_id",), "s" * (MAX_BYTES + draw(st.integers(1, 5000))))), {"oversized"}
    mr = next(b for b in BASES if b["type"] == "model.responded")
    if kind == "bad_tokens":
        junk = draw(st.sampled_from(["not base64!", "AAA", "AAAAAAA=", "@@@@"]))  # 5 bytes: not <i4
        return _dumps(
            _set(
                mr,
                ("payload", draw(st.sampled_from(["prompt_token_ids", "completion_token_ids", "completion_logprobs"]))),
                junk,
            )
        ), {"validation"}
    # "lengths": log-probs that do not match the completion tokens
    n_tokens = len(base64.b64decode(mr["payload"]["completion_token_ids"])) // 4
    n = draw(st.integers(0, n_tokens + 5).filter(lambda k: k != n_tokens))
    logprobs = base64.b64encode(np.full(n, -1.0, dtype="<f4").tobytes()).decode()
    return _dumps(_set(mr, ("payload", "completion_logprobs"), logprobs)), {"validation"}


def generate_malformed(n: int) -> list[tuple[bytes | None, str]]:
    """``n`` malformed messages from hypothesis, each checked to be dead-lettered with an allowed reason."""
    out: list[tuple[bytes | None, str]] = []

    @settings(
        max_examples=n, database=None, deadline=None, phases=[Phase.generate], suppress_health_check=list(HealthCheck)
    )
    @given(m=malformed())
    def collect(m):
        raw, allowed = m
        d = classify(Message("t", 0, 0, None, raw), MAX_BYTES)
        assert d.event is None and d.reason in allowed, (raw[:300] if raw else raw, d.reason, d.detail, allowed)
        out.append((raw, d.reason))

    while len(out) < n:
        collect()
    return out[:n]


def test_classify_never_raises_and_always_decides():
    for _raw, reason in generate_malformed(300):
        assert reason in {
            "bad_json",
            "not_object",
            "unknown_type",
            "schema_version",
            "validation",
            "unstorable",
            "oversized",
        }
    for e in BASES:
        d = classify(Message("t", 0, 0, None, encode_event(EVENT_CLASSES[e["type"]].model_validate(e))), MAX_BYTES)
        assert d.reason is None and d.row is not None and json.loads(d.row.payload)


@pytest.mark.integration
def test_malformed_messages_are_dead_lettered_and_valid_ones_around_them_stored(
    db, topics, kafka_bootstrap, monkeypatch
):
    monkeypatch.setenv("FLYWHEEL_KAFKA_MAX_EVENT_BYTES", str(MAX_BYTES))
    bad = generate_malformed(1000)
    valid = generate_stream(3000, seed=9)
    records = [kafka_record(e) for e in valid]
    rng = random.Random(5)
    for raw, _ in bad:  # interleave, keyed like real sessions so they spread over partitions
        key = rng.choice(records)[0]
        records.insert(rng.randrange(len(records) + 1), (key, raw, [("event-type", b"?")]))
    produce(kafka_bootstrap, topics["interactions"], records)

    from consumers.ingest import IngestConsumer

    stats = IngestConsumer().run(idle_exit_s=3)
    assert stats.processing_errors == 0
    assert sum(stats.dead_letters.values()) == 1000

    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT raw, reason, topic, detail FROM dead_letter").fetchall()
        stored = {r[0] for r in conn.execute("SELECT event_id FROM event_log")}
    assert len(rows) == 1000
    assert Counter(r[1] for r in rows) == Counter(reason for _, reason in bad)
    # A record that claims privacy mode (a mutated flag) makes its session private whole: its own
    # bytes and those of the session's other dead letters are not kept, its valid events not stored.
    claims = [claim_of(raw, MAX_BYTES) if raw is not None and reason != "oversized" else None for raw, reason in bad]
    private = {c.session_id for c in claims if c is not None and c.privacy_mode and c.session_id}
    kept = [
        raw if c is None or not (c.privacy_mode or c.session_id in private) else None
        for (raw, _), c in zip(bad, claims)
    ]
    assert sorted((bytes(r[0]) if r[0] is not None else b"<none>") for r in rows) == sorted(
        raw if raw is not None else b"<none>" for raw in kept
    )
    assert all(r[2] == topics["interactions"] and r[3] for r in rows)
    assert stored == {e.event_id for e in valid if e.session_id not in private}

    dlq = read_topic(kafka_bootstrap, topics["dlq"])
    assert Counter(dict(m.headers)["dlq-reason"].decode() for m in dlq) == Counter(reason for _, reason in bad)
    # on the topic, a private session's dead letter published before its session's flag keeps its bytes
    redacted = [raw for (raw, _), k in zip(bad, kept) if raw is not None and k is None]
    published = Counter(m.value for m in dlq)
    for raw in redacted:
        published[raw if published[raw] else b""] -= 1
    assert {v: n for v, n in published.items() if n} == Counter(
        raw or b"" for (raw, _), k in zip(bad, kept) if raw is None or k is not None
    )


@pytest.mark.integration
def test_a_record_that_breaks_processing_is_dead_lettered_and_the_batch_goes_on(
    db, topics, kafka_bootstrap, monkeypatch
):
    from consumers.ingest import IngestConsumer
    from consumers.projection import Projector

    events = generate_stream(300, seed=13)
    poison = next(e for e in events if e.type == "tool.executed")
    apply = Projector.apply

    def failing_apply(self, t, se):  # a projection bug that only this record triggers
        if se.event.event_id == poison.event_id:
            raise RuntimeError("projection bug")
        return apply(self, t, se)

    monkeypatch.setattr(Projector, "apply", failing_apply)
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events])
    stats = IngestConsumer().run(idle_exit_s=1.5)
    assert stats.processing_errors == 1
    with psycopg.connect(db) as conn:
        rows = conn.execute("SELECT reason, detail, raw FROM dead_letter").fetchall()
        stored = {r[0] for r in conn.execute("SELECT event_id FROM event_log")}
    assert [(r[0], bytes(r[2])) for r in rows] == [("processing_error", encode_event(poison))]
    assert "projection bug" in rows[0][1]
    assert stored == {e.event_id for e in events} - {poison.event_id}
    # published once, with the transaction that stored it: not by the whole-batch attempt that failed
    assert [(m.value, dict(m.headers)["dlq-reason"]) for m in read_topic(kafka_bootstrap, topics["dlq"])] == [
        (encode_event(poison), b"processing_error")
    ]


@pytest.mark.integration
def test_a_column_the_database_lacks_is_waited_out_not_dead_lettered(db, topics, kafka_bootstrap, caplog):
    """New consumer code on a database whose migration has not run yet (a deploy in the wrong order):
    every insert fails on the missing column. That is the database's fault, not the records': the
    batch is retried until the column is there, then stored whole, with no dead letter."""
    from consumers.ingest import IngestConsumer

    events = generate_stream(300, seed=17)
    with psycopg.connect(db, autocommit=True) as conn:
        conn.execute("ALTER TABLE event_log RENAME COLUMN trace_id TO trace_id_next")  # position kept
    try:
        produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events])
        consumer = IngestConsumer()
        result: dict = {}
        runner = threading.Thread(target=lambda: result.update(stats=consumer.run(idle_exit_s=1.5)), daemon=True)
        caplog.set_level("WARNING", logger="app.core.retry")
        runner.start()
        deadline = time.monotonic() + 60
        while "trace_id" not in caplog.text and time.monotonic() < deadline:
            time.sleep(0.2)
        assert "trace_id" in caplog.text, "the batch never reached the missing column"
    finally:
        with psycopg.connect(db, autocommit=True) as conn:
            conn.execute("ALTER TABLE event_log RENAME COLUMN trace_id_next TO trace_id")
    runner.join(120)
    assert not runner.is_alive() and result["stats"].processing_errors == 0
    with psycopg.connect(db) as conn:
        assert conn.execute("SELECT count(*) FROM dead_letter").fetchone()[0] == 0
        stored = {r[0] for r in conn.execute("SELECT event_id FROM event_log")}
    assert stored == {e.event_id for e in events}

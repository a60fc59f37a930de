"""Which user a dead letter claims to be from (what an erasure looks it up by), and whether an erasure
covers it."""

from __future__ import annotations

import base64
from datetime import UTC, datetime, timedelta

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from consumers.classify import Decoded, Message
from consumers.deadletter import (
    Claim,
    claim_of,
    covered_by_erasure,
    dead_letter_row,
    dlq_record,
    header_bytes,
    header_text,
    redacted,
    redacted_private,
)
from consumers.redrive import redrive_headers
from consumers.trajectory_state import trajectory_id_for


@pytest.mark.parametrize(
    "raw,expected",
    [
        (b'{"user_id": "u-1", "type": "nope"}', "u-1"),
        (b'{"type": "nope", "payload": {}, "user_id": "u-2"}', "u-2"),
        (b'{"user_id": "u-1", "type": "sess', None),  # not JSON: found by its bytes instead
        (b'["user_id", "u-1"]', None),  # not an object
        (b'{"payload": {"user_id": "u-1"}}', None),  # only top-level fields count
        (b'{"user_id": 7}', None),
        (b'{"user_id": ""}', None),
        (b'{"user_id": "' + b"x" * 129 + b'"}', None),  # wider than the column
        (b'{"user_id": "a\\u0000b"}', None),  # Postgres would refuse it
        (b'{"user_id": "u-1", "n": NaN}', None),
        (b"\xff\xfe", None),
        (b"", None),
        (None, None),
    ],
)
def test_claimed_user_id(raw, expected):
    assert claim_of(raw, 1024).user_id == expected


def test_an_oversized_record_is_not_parsed_for_its_user():
    raw = b'{"user_id": "u-1", "pad": "' + b"x" * 2000 + b'"}'
    assert claim_of(raw, 1024).user_id is None
    assert claim_of(raw, 4096).user_id == "u-1"
    msg = Message("t", 0, 5, None, raw)
    assert dead_letter_row(Decoded(msg, reason="oversized", detail="too big")).user_id is None
    assert dead_letter_row(Decoded(msg, reason="validation", detail="bad")).user_id == "u-1"


def test_claim_of_reads_session_and_an_aware_occurred_at():
    raw = b'{"user_id": "u-1", "session_id": "s-1", "occurred_at": "2026-11-21T10:00:00Z", "type": "nope"}'
    assert claim_of(raw, 1024) == Claim("u-1", "s-1", datetime(2026, 11, 21, 10, tzinfo=UTC))
    assert claim_of(b'{"user_id": "u-1", "occurred_at": "2026-11-21T10:00:00"}', 1024).occurred_at is None  # naive
    assert claim_of(b'{"user_id": "u-1", "occurred_at": "yesterday"}', 1024) == Claim("u-1")
    assert claim_of(b'{"user_id": "u-1", "occurred_at": 1700000000}', 1024) == Claim("u-1")
    assert claim_of(b'{"session_id": ["s"]}', 1024) == Claim()


@pytest.mark.parametrize(
    "flag,private",
    [
        ("true", True),
        ('"yes"', True),
        ('"false"', True),
        ("1", True),  # a malformed flag errs toward privacy
        ("false", False),
        ("0", False),
        ("null", False),
        (None, False),
    ],
)
def test_claim_of_reads_the_privacy_flag(flag, private):
    raw = b'{"session_id": "s-1"' + (b', "privacy_mode": ' + flag.encode() if flag else b"") + b"}"
    assert claim_of(raw, 1024) == Claim(None, "s-1", None, private)


REQUESTED = datetime(2026, 11, 21, 12, tzinfo=UTC)
ERASED = {"u-1": (REQUESTED, {trajectory_id_for("s-old")})}


@pytest.mark.parametrize(
    "claim,covered",
    [
        (Claim("u-1", "s-new", REQUESTED - timedelta(seconds=1)), True),  # occurred before the request
        (Claim("u-1", "s-new", REQUESTED), True),
        (Claim("u-1", "s-old", REQUESTED + timedelta(hours=1)), True),  # a session the erasure deleted
        (Claim("u-1", None, REQUESTED + timedelta(hours=1)), True),  # says neither which session...
        (Claim("u-1", "s-new", None), True),  # ...nor when: taken as covered
        (Claim("u-1", "s-new", REQUESTED + timedelta(seconds=1)), False),  # a new session after the request
        (Claim("u-2", "s-old", REQUESTED - timedelta(hours=1)), False),  # another user
        (Claim(None, "s-old", None), False),
    ],
)
def test_covered_by_erasure_follows_the_ingest_rule_for_events(claim, covered):
    assert covered_by_erasure(claim, ERASED) == (REQUESTED if covered else None)


def test_a_redacted_dead_letter_keeps_its_place_not_its_bytes():
    raw = b'{"user_id": "u-1", "session_id": "s-old", "type": "nope"}'
    msg = Message("t", 3, 9, b"s-old", raw, [("traceparent", b"00-" + b"a" * 32 + b"-" + b"b" * 16 + b"-01")])
    row = redacted(dead_letter_row(Decoded(msg, reason="unknown_type", detail="unknown type 'nope'")), REQUESTED)
    assert (row.topic, row.partition, row.offset, row.reason, row.user_id) == ("t", 3, 9, "unknown_type", "u-1")
    assert row.key is None and row.raw is None and row.headers is None
    assert row.detail.startswith("raw bytes not kept") and row.detail.endswith("unknown type 'nope'")
    assert dlq_record(row, 1024)[:2] == (None, b"") and ("dlq-redacted", b"erasure") in dlq_record(row, 1024)[2]


def test_a_private_sessions_dead_letter_keeps_its_place_and_session_not_its_bytes():
    raw = b'{"user_id": "u-1", "session_id": "s-p", "privacy_mode": true, "type": "nope"}'
    row = redacted_private(
        dead_letter_row(Decoded(Message("t", 3, 9, b"s-p", raw), reason="unknown_type", detail="unknown type 'nope'"))
    )
    assert (row.offset, row.reason, row.user_id, row.session_id, row.redacted) == (
        9,
        "unknown_type",
        "u-1",
        "s-p",
        "privacy",
    )
    assert row.key is None and row.raw is None and row.headers is None
    assert row.detail.startswith("raw bytes not kept: the session is in privacy mode")
    key, value, headers = dlq_record(row, 1024)
    assert (key, value) == (None, b"") and ("dlq-redacted", b"privacy") in headers


@settings(max_examples=300, deadline=None)
@given(
    st.one_of(
        st.binary(max_size=64),
        st.text(max_size=32).map(lambda t: t.encode("utf-8", "surrogatepass")),
        st.binary(max_size=24).map(lambda b: b"base64:" + b),
        st.binary(max_size=24).map(lambda b: b"base64:" + base64.b64encode(b)),
    )
)
def test_stored_header_text_round_trips_to_the_same_bytes(value: bytes):
    """What ``dead_letter`` stores of a header (text a jsonb column holds: no NUL) comes back as the
    header's bytes on redrive, even a text that itself looks like the base64 encoding."""
    text = header_text(value)
    assert "\x00" not in text
    text.encode("utf-8")  # no lone surrogate either
    assert header_bytes(text) == value


def test_a_header_text_with_the_base64_prefix_is_escaped_and_redriven_as_sent():
    sent = [("base64:aGk=", b"base64:aGk="), ("trace", b"\xff\x00")]
    row = dead_letter_row(Decoded(Message("t", 0, 1, None, b"x", sent), reason="bad_json"))
    assert row.headers == [
        ["base64:" + base64.b64encode(b"base64:aGk=").decode()] * 2,
        ["trace", "base64:" + base64.b64encode(b"\xff\x00").decode()],
    ]
    assert redrive_headers(row.headers, "t:0:1")[:2] == sent

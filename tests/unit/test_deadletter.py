"""Which user a dead letter claims to be from (what an erasure looks it up by)."""

from __future__ import annotations

import pytest

from consumers.deadletter import Decoded, Message, claimed_user_id, dead_letter_row


@pytest.mark.parametrize("raw,expected", [
    (b'{"user_id": "u-1", "type": "nope"}', "u-1"),
    (b'{"type": "nope", "payload": {}, "user_id": "u-2"}', "u-2"),
    (b'{"user_id": "u-1", "type": "sess', None),            # not JSON: found by its bytes instead
    (b'["user_id", "u-1"]', None),                          # not an object
    (b'{"payload": {"user_id": "u-1"}}', None),             # only top-level fields count
    (b'{"user_id": 7}', None),
    (b'{"user_id": ""}', None),
    (b'{"user_id": "' + b"x" * 129 + b'"}', None),          # wider than the column
    (b'{"user_id": "a\\u0000b"}', None),                    # Postgres would refuse it
    (b'{"user_id": "u-1", "n": NaN}', None),
    (b"\xff\xfe", None),
    (b"", None),
    (None, None),
])
def test_claimed_user_id(raw, expected):
    assert claimed_user_id(raw, 1024) == expected


def test_an_oversized_record_is_not_parsed_for_its_user():
    raw = b'{"user_id": "u-1", "pad": "' + b"x" * 2000 + b'"}'
    assert claimed_user_id(raw, 1024) is None
    assert claimed_user_id(raw, 4096) == "u-1"
    msg = Message("t", 0, 5, None, raw)
    assert dead_letter_row(Decoded(msg, reason="oversized", detail="too big")).user_id is None
    assert dead_letter_row(Decoded(msg, reason="validation", detail="bad")).user_id == "u-1"

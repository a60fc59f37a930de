"""The event contract: round trips, schema versions, rejections with reasons."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from app.core.errors import InvalidEventError
from producers.events import EVENT_CLASSES, decode_event, decode_event_payload, encode_event, event_json_schema
from producers.events.plausibility import MAX_VOCAB_SIZE
from producers.events.types import ModelResponded, ModelRespondedEvent, SessionEnded, SessionEndedEvent, ToolCall


def _responded(**kw) -> ModelRespondedEvent:
    payload = dict(
        request_id="r1",
        segment_index=0,
        turn_index=0,
        checkpoint_id="base",
        prompt_token_ids=[1, 2, 3],
        completion_token_ids=[4, 5],
        completion_logprobs=[-0.5, -1.25],
        latency_s=0.3,
        tool_calls=[ToolCall(call_id="c1", name="run", arguments={"cmd": "pytest"})],
    )
    payload.update(kw)
    return ModelRespondedEvent(session_id="s1", user_id="u1", payload=ModelResponded(**payload))


@given(
    tokens=st.lists(st.integers(0, MAX_VOCAB_SIZE - 1), min_size=1, max_size=64),
    prompt=st.lists(st.integers(0, 49_151), max_size=64),
)
@settings(max_examples=50, deadline=None)
def test_model_responded_round_trips_exactly(tokens, prompt):
    logprobs = [-(i % 7) / 3 for i in range(len(tokens))]
    event = _responded(completion_token_ids=tokens, completion_logprobs=logprobs, prompt_token_ids=prompt)
    decoded = decode_event(encode_event(event))
    assert decoded == event
    assert decoded.payload.completion_token_ids == tuple(tokens)


@pytest.mark.parametrize(
    "kw,field",
    [
        (dict(completion_logprobs=[-0.5, 0.5]), "completion_logprobs"),
        (dict(completion_logprobs=[float("nan"), -1.0]), "completion_logprobs"),
        (dict(completion_token_ids=[4, MAX_VOCAB_SIZE]), "completion_token_ids"),
        (dict(prompt_token_ids=[1, -2]), "prompt_token_ids"),
        (dict(vocab_size=5), "completion_token_ids"),  # ids 4, 5 in a 5-token vocabulary
        (dict(completion_token_ids=[], completion_logprobs=[]), "completion_token_ids"),
    ],
)
def test_implausible_turns_are_refused_naming_the_field(kw, field):
    import base64

    import numpy as np

    event = json.loads(encode_event(_responded()))
    for k, v in kw.items():
        dtype = "<f4" if k == "completion_logprobs" else "<i4"
        event["payload"][k] = v if k == "vocab_size" else base64.b64encode(np.asarray(v, dtype).tobytes()).decode()
    with pytest.raises(InvalidEventError) as err:
        decode_event(json.dumps(event).encode())
    assert err.value.reason == "implausible" and field in err.value.message


def test_a_logprob_rounded_just_above_zero_is_accepted():
    assert decode_event(encode_event(_responded(completion_logprobs=[1e-5, -0.1]))).payload.completion_logprobs[0] > 0


def test_token_arrays_are_binary_packed_not_json_lists():
    wire = json.loads(encode_event(_responded(completion_token_ids=list(range(100)), completion_logprobs=[-1.0] * 100)))
    assert isinstance(wire["payload"]["completion_token_ids"], str)
    assert isinstance(wire["payload"]["completion_logprobs"], str)


def test_event_ids_are_uuid7_and_time_ordered():
    a, b = _responded(), _responded()
    assert a.event_id.version == 7 and a.event_id < b.event_id


def test_events_are_frozen():
    event = _responded()
    with pytest.raises(Exception):
        event.session_id = "other"  # type: ignore[misc]


@pytest.mark.parametrize(
    ("raw", "reason"),
    [
        (b"{not json", "bad_json"),
        (b"\xff\xfe", "bad_json"),
        (b"[1, 2]", "not_object"),
        (json.dumps({"type": "model.exploded", "session_id": "s", "user_id": "u"}).encode(), "unknown_type"),
        (
            json.dumps(
                {"type": "session.ended", "schema_version": 99, "session_id": "s", "user_id": "u", "payload": {}}
            ).encode(),
            "schema_version",
        ),
        (
            json.dumps({"type": "session.ended", "schema_version": 1, "user_id": "u", "payload": {}}).encode(),
            "validation",
        ),
        (b"x" * 2000, "oversized"),
        # NaN is not JSON, even where the contract takes any value (a tool call's arguments)
        (encode_event(_responded()).replace(b'{"cmd":"pytest"}', b'{"cmd":NaN}'), "bad_json"),
    ],
    ids=[
        "bad-json",
        "bad-utf8",
        "not-object",
        "unknown-type",
        "schema-version",
        "no-session",
        "oversized",
        "nan-argument",
    ],  # stable ids: the raw bytes hold fresh timestamps (pytest-xdist collects per worker)
)
@pytest.mark.parametrize("decode", [decode_event, decode_event_payload])
def test_decode_rejects_with_reason(raw, reason, decode):
    with pytest.raises(InvalidEventError) as info:
        decode(raw, max_bytes=1500)
    assert info.value.reason == reason
    assert isinstance(info.value, ValueError)


def test_stored_payload_is_the_payload_as_sent():
    sent = {
        "type": "tool.executed",
        "session_id": "s",
        "user_id": "u",
        "payload": {"ok": True, "name": "run", "call_id": "c1", "duration_s": 2, "output": "\u00e9t\u00e9"},
    }
    event, payload = decode_event_payload(json.dumps(sent).encode())
    # the producer's bytes: fields, order, numbers, spacing and escapes
    assert payload == json.dumps(sent["payload"])
    assert json.loads(payload)["output"] == "été"
    assert event.payload.duration_s == 2.0 and "exit_code" not in json.loads(payload)
    # an integer beyond 64 bits is kept exactly
    big = 123456789012345678901234567890
    raw = encode_event(_responded()).replace(b'{"cmd":"pytest"}', b'{"n":%d}' % big)
    event, payload = decode_event_payload(raw)
    assert json.loads(payload)["tool_calls"][0]["arguments"] == {"n": big}
    assert decode_event(raw) == event
    # a repeated key: the value validation took (the last), not the first
    raw = (
        json.dumps({**sent, "payload": {"x": 1}}).encode()[:-1]
        + b', "payload": '
        + json.dumps(sent["payload"]).encode()
        + b"}"
    )
    event, payload = decode_event_payload(raw)
    assert json.loads(payload) == sent["payload"] and event.payload.name == "run"


def test_a_lone_surrogate_escape_is_bad_json():
    # Postgres refuses it in json text; the stored payload is the producer's bytes, so it must not pass
    sent = {"type": "followup.sent", "session_id": "s", "user_id": "u", "payload": {"text": "a"}}
    raw = json.dumps(sent).encode().replace(b'"a"', b'"\\ud800"')
    with pytest.raises(InvalidEventError) as info:
        decode_event_payload(raw)
    assert info.value.reason == "bad_json"


def test_logprobs_length_must_match_tokens():
    with pytest.raises(ValueError, match="completion_logprobs"):
        _responded(completion_token_ids=[1, 2, 3], completion_logprobs=[-1.0])


def test_naive_timestamps_are_rejected_and_aware_ones_normalized_to_utc():
    data = json.loads(encode_event(SessionEndedEvent(session_id="s", user_id="u", payload=SessionEnded())))
    data["occurred_at"] = "2026-01-01T10:00:00"
    with pytest.raises(InvalidEventError):
        decode_event(json.dumps(data).encode())
    data["occurred_at"] = "2026-01-01T12:00:00+02:00"
    assert decode_event(json.dumps(data).encode()).occurred_at.isoformat() == "2026-01-01T10:00:00+00:00"


def test_json_schema_covers_every_event_type():
    schema = json.dumps(event_json_schema())
    for etype in EVENT_CLASSES:
        assert etype in schema
    assert len(EVENT_CLASSES) == 12

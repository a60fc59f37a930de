"""Wire codec: events <-> Kafka value bytes (UTF-8 JSON), with reasons a dead-letter row can carry.

``decode_event`` never raises anything but :class:`InvalidEventError`, whose ``reason`` is one of
``oversized``, ``bad_json``, ``not_object``, ``unknown_type``, ``schema_version``, ``implausible``
(a value no real session produces: ``producers.events.plausibility``), ``validation``. The detail of the
last two names the field.
It parses and validates in one pass (pydantic-core's JSON parser straight into the typed models,
no intermediate dict): the consumers decode every event, so this is on the hot path. That parser
accepts ``NaN``/``Infinity``, which are not JSON; a record holding those bytes is parsed again
strictly (orjson) and refused as ``bad_json``. The consumers use ``decode_event_payload``, whose
strict second pass (msgspec, which refuses them too) also yields the payload to store.
"""

from __future__ import annotations

from typing import Any

import msgspec
import orjson
from pydantic import TypeAdapter, ValidationError

from producers.errors import InvalidEventError
from producers.events.types import EVENT_CLASSES, Event, EventBase

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

DEFAULT_MAX_EVENT_BYTES = 1_048_576


class _PayloadSlice(msgspec.Struct):
    payload: msgspec.Raw


_PAYLOAD_SLICE = msgspec.json.Decoder(_PayloadSlice)
"""Finds the top-level ``payload`` value's bytes in a record (strict JSON, not decoded into objects)."""


def encode_event(event: EventBase) -> bytes:
    """Serialize an event to its wire bytes (compact JSON, token arrays base64-packed)."""
    return event.model_dump_json().encode("utf-8")


def _invalid(exc: ValidationError, etype: str | None = None) -> InvalidEventError:
    """The dead-letter reason of a validation failure (first matching rule wins):
    not JSON -> ``bad_json``; not an object -> ``not_object``; no or unknown ``type`` ->
    ``unknown_type``; any problem with ``schema_version`` -> ``schema_version``; an ``implausible``
    value (``producers.events.plausibility``) -> ``implausible``; else ``validation``."""
    errors = exc.errors(include_url=False, include_input=False)
    kinds = {e["type"] for e in errors if not e["loc"]}
    if "json_invalid" in kinds:
        return InvalidEventError("bad_json", f"not JSON: {errors[0]['msg']}")
    if kinds & {"dict_type", "model_type", "model_attributes_type"}:
        return InvalidEventError("not_object", "event must be a JSON object")
    if kinds & {"union_tag_invalid", "union_tag_not_found"}:
        return InvalidEventError("unknown_type", f"unknown or missing event type: {errors[0]['msg']}")
    # Union errors are located under the tag; a single class's are not.
    if etype is None:
        etype = str(errors[0]["loc"][0]) if errors and errors[0]["loc"] else "event"
        strip = 1
    else:
        strip = 0
    for e in errors:
        if tuple(e["loc"][strip : strip + 1]) == ("schema_version",):
            return InvalidEventError("schema_version", f"{etype}: schema_version: {e['msg']}")
    detail = "; ".join(f"{'.'.join(str(p) for p in e['loc'][strip:]) or '<root>'}: {e['msg']}" for e in errors[:5])
    reason = "implausible" if any(e["type"] == "implausible" for e in errors) else "validation"
    return InvalidEventError(reason, f"{etype}: {detail}")


def validate_event(data: dict[str, Any] | EventBase) -> EventBase:
    """Validate a dict (or re-validate an event) into its typed envelope.

    Raises:
        InvalidEventError: not an object, unknown type, unsupported schema version, or invalid fields.
    """
    if isinstance(data, EventBase):
        return data
    if not isinstance(data, dict):
        raise InvalidEventError("not_object", f"event must be a JSON object, got {type(data).__name__}")
    etype = data.get("type")
    cls = EVENT_CLASSES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise InvalidEventError("unknown_type", f"unknown event type {etype!r}")
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        raise _invalid(exc, etype) from None


def _validate_bytes(raw: bytes | None, max_bytes: int) -> EventBase:
    if raw is None:
        raise InvalidEventError("bad_json", "empty message value")
    if len(raw) > max_bytes:
        raise InvalidEventError("oversized", f"event is {len(raw)} bytes, limit {max_bytes}")
    try:
        return _ADAPTER.validate_json(raw)
    except ValidationError as exc:
        raise _invalid(exc) from None


def _refuse_non_strict(raw: bytes) -> None:
    if b"NaN" in raw or b"Infinity" in raw:  # rare: only then parse strictly
        try:
            orjson.loads(raw)
        except orjson.JSONDecodeError as exc:
            raise InvalidEventError("bad_json", f"not strict JSON: {exc}") from None


def decode_event(raw: bytes | None, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> EventBase:
    """Decode Kafka value bytes into a typed event.

    Raises:
        InvalidEventError: see the module docstring for reasons.
    """
    event = _validate_bytes(raw, max_bytes)
    _refuse_non_strict(raw)  # type: ignore[arg-type]
    return event


def decode_event_payload(raw: bytes | None, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> tuple[EventBase, str]:
    """:func:`decode_event`, plus the event's payload as JSON text to store: the payload object's
    bytes exactly as the producer sent them (its fields, order, numbers and spacing), sliced out of
    the record by a strict JSON pass (msgspec's ``Raw``: the rest of the record is checked, not
    built into objects; it refuses ``NaN``/``Infinity`` and lone surrogate escapes, standing in
    for :func:`decode_event`'s byte scan for them). Input it refuses takes the slow path: the scan,
    then the validated payload serialized with the fields the producer set. ~1 us a record, against
    ~5 us to parse the payload again and re-encode it (bench/ingest.py).

    Raises:
        InvalidEventError: as :func:`decode_event`.
        pydantic_core.PydanticSerializationError: a validated payload that cannot be serialized
            (slow path only).
    """
    event = _validate_bytes(raw, max_bytes)
    try:
        return event, bytes(_PAYLOAD_SLICE.decode(raw).payload).decode()  # type: ignore[arg-type]
    except (msgspec.DecodeError, UnicodeDecodeError):
        _refuse_non_strict(raw)  # type: ignore[arg-type]
        return event, event.payload.model_dump_json(exclude_unset=True)


def event_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the event union, exported from the pydantic models."""
    schema = _ADAPTER.json_schema(mode="serialization")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "flywheel editor-interaction event"
    return schema

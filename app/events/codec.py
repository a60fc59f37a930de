"""Wire codec: events <-> Kafka value bytes (UTF-8 JSON), with reasons a dead-letter row can carry.

``decode_event`` never raises anything but :class:`InvalidEventError`, whose ``reason`` is one of
``oversized``, ``bad_json``, ``not_object``, ``unknown_type``, ``schema_version``, ``validation``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import TypeAdapter, ValidationError

from app.core.errors import InvalidEventError
from app.events.types import EVENT_CLASSES, Event, EventBase

_ADAPTER: TypeAdapter[Event] = TypeAdapter(Event)

DEFAULT_MAX_EVENT_BYTES = 1_048_576


def encode_event(event: EventBase) -> bytes:
    """Serialize an event to its wire bytes (compact JSON, token arrays base64-packed)."""
    return event.model_dump_json().encode("utf-8")


def validate_event(data: dict[str, Any] | EventBase) -> EventBase:
    """Validate a dict (or re-validate an event) into its typed envelope.

    Raises:
        InvalidEventError: unknown type, unsupported schema version, or invalid fields.
    """
    if isinstance(data, EventBase):
        return data
    if not isinstance(data, dict):
        raise InvalidEventError("not_object", f"event must be a JSON object, got {type(data).__name__}")
    etype = data.get("type")
    cls = EVENT_CLASSES.get(etype) if isinstance(etype, str) else None
    if cls is None:
        raise InvalidEventError("unknown_type", f"unknown event type {etype!r}")
    version = data.get("schema_version", cls.SCHEMA_VERSION)
    if version != cls.SCHEMA_VERSION:
        raise InvalidEventError(
            "schema_version", f"{etype} schema_version {version!r} not supported (expected {cls.SCHEMA_VERSION})"
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        errors = "; ".join(
            f"{'.'.join(str(p) for p in e['loc']) or '<root>'}: {e['msg']}" for e in exc.errors()[:5]
        )
        raise InvalidEventError("validation", f"{etype}: {errors}") from None


def decode_event(raw: bytes | None, max_bytes: int = DEFAULT_MAX_EVENT_BYTES) -> EventBase:
    """Decode Kafka value bytes into a typed event.

    Raises:
        InvalidEventError: see the module docstring for reasons.
    """
    if raw is None:
        raise InvalidEventError("bad_json", "empty message value")
    if len(raw) > max_bytes:
        raise InvalidEventError("oversized", f"event is {len(raw)} bytes, limit {max_bytes}")
    try:
        data = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise InvalidEventError("bad_json", f"not JSON: {exc}") from None
    return validate_event(data)


def event_json_schema() -> dict[str, Any]:
    """JSON Schema (draft 2020-12) of the event union, exported from the pydantic models."""
    schema = _ADAPTER.json_schema(mode="serialization")
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "flywheel editor-interaction event"
    return schema

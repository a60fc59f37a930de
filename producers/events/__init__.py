"""The event contract: typed, frozen, versioned envelopes and their wire codec."""

from producers.events.codec import decode_event, decode_event_payload, encode_event, event_json_schema, validate_event
from producers.events.types import *  # noqa: F401,F403
from producers.events.types import EVENT_CLASSES, Event, EventBase

__all__ = [
    "decode_event",
    "decode_event_payload",
    "encode_event",
    "event_json_schema",
    "validate_event",
    "EVENT_CLASSES",
    "Event",
    "EventBase",
]

"""Turning Kafka records into storable events, or into dead letters with a reason.

Invariant: :func:`classify` never raises for any input bytes. A record is either an event that
Postgres can store as it is (``EventRow`` + the typed event) or a dead letter with a reason:
``oversized``, ``bad_json``, ``not_object``, ``unknown_type``, ``schema_version``, ``implausible``,
``validation`` (the codec's reasons; ``implausible`` also for an ``occurred_at`` outside the
ingestion time window), ``unstorable`` (valid JSON Postgres would refuse: a ``\\u0000`` in a
string) or, later in the batch, ``conflicting_duplicate`` (:func:`conflicting_duplicates`, called by
``consumers.batch``). ``consumers.deadletter`` stores and publishes the dead letters.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import orjson
from sqlalchemy.orm import Session

from app.core.errors import InvalidEventError
from app.repositories.events import BODY_COLUMNS, EventRow, body_of, stored_bodies
from producers.events import decode_event_payload
from producers.events.plausibility import TimeWindow, check_occurred_at
from producers.events.types import EventBase

MAX_SEGMENT_INDEX = 100_000
"""Segments per trajectory the projection accepts (an int4 column; real sessions have a handful)."""
_TRACEPARENT = re.compile(rb"[0-9a-f]{2}-([0-9a-f]{32})-([0-9a-f]{16})-[0-9a-f]{2}\Z")


class Message(NamedTuple):
    """A consumed Kafka record, independent of the client library (a tuple: one per record)."""

    topic: str
    partition: int
    offset: int
    key: bytes | None
    value: bytes | None
    headers: Sequence[tuple[str, bytes]] = ()
    log_id: str | None = None
    """the identity of the partition's log it was read from (``app.core.kafka_meta.log_id_of``), if known"""

    @classmethod
    def from_record(cls, rec: Any, log_id: str | None = None) -> "Message":
        """From a kafka-python ``ConsumerRecord`` read from the log ``log_id``."""
        return cls(rec.topic, rec.partition, rec.offset, rec.key, rec.value, rec.headers or (), log_id)


@dataclass
class Decoded:
    """The outcome of :func:`classify`: exactly one of ``event``/``reason`` is set."""

    msg: Message
    event: EventBase | None = None
    row: EventRow | None = None
    reason: str | None = None
    detail: str = ""


def why_unstorable(v: Any) -> str | None:
    """Why Postgres would refuse a parsed JSON value (a NUL or a lone surrogate in a string, a
    non-finite number, at any depth), or None."""
    if isinstance(v, str):
        if "\x00" in v:
            return "NUL character in a string"
        try:
            v.encode("utf-8")
        except UnicodeEncodeError:
            return "lone surrogate in a string"
    elif isinstance(v, float):
        if not math.isfinite(v):
            return "non-finite number"
    elif isinstance(v, dict):
        for k, x in v.items():
            why = why_unstorable(k) or why_unstorable(x)
            if why:
                return why
    elif isinstance(v, list):
        for x in v:
            why = why_unstorable(x)
            if why:
                return why
    return None


def trace_context_of(headers: Sequence[tuple[str, bytes]]) -> tuple[str | None, str | None]:
    """The producer's ``(trace id, span id)`` (32 and 16 lower-case hex digits) from a W3C
    ``traceparent`` header; ``(None, None)`` when there is none or it is malformed."""
    for k, v in headers:
        if k == "traceparent" and v:
            m = _TRACEPARENT.match(v)
            if m:
                return m.group(1).decode("ascii"), m.group(2).decode("ascii")
    return None, None


_NUL_ESCAPE = b"\\u0000"


def classify(msg: Message, max_bytes: int, window: TimeWindow | None = None) -> Decoded:
    """Decode one record into a storable event or a dead letter (never raises).

    The checks and reasons of ``producers.events.decode_event_payload`` (validation straight from the
    bytes, then a strict pass that also gives the payload to store: the payload object's bytes as
    the producer sent them; the replay path validates it again), plus a NUL in a string is
    ``unstorable`` (Postgres refuses it; a byte search decides whether to look), and an
    ``occurred_at`` outside ``window`` (if given: the ingestion time's plausible window) is
    ``implausible``.
    """
    raw = msg.value
    try:
        event, payload = decode_event_payload(raw, max_bytes)
        if _NUL_ESCAPE in raw:  # type: ignore[operator]  # rare: only then walk the values
            why = why_unstorable(orjson.loads(raw))  # type: ignore[arg-type]
            if why:
                return Decoded(msg, reason="unstorable", detail=why)
    except InvalidEventError as exc:
        return Decoded(msg, reason=exc.reason, detail=exc.message[:2000])
    except Exception as exc:  # noqa: BLE001 -- input must never crash the consumer
        return Decoded(msg, reason="validation", detail=f"{type(exc).__name__}: {exc}"[:2000])
    if window is not None:
        why = check_occurred_at(event.occurred_at, window)
        if why:
            return Decoded(msg, reason="implausible", detail=f"{event.type}: {why}")
    p = event.payload
    index = (
        p.segment_index
        if event.type == "model.responded"
        else p.new_segment_index
        if event.type == "context.summarized"
        else None
    )
    if index is not None and index > MAX_SEGMENT_INDEX:
        return Decoded(msg, reason="validation", detail=f"segment index {index} > {MAX_SEGMENT_INDEX}")
    trace_id, span_id = trace_context_of(msg.headers)
    row = EventRow(
        event.event_id,
        event.type,
        event.schema_version,
        event.occurred_at,  # positional: ~0.5 us less
        event.session_id,
        event.user_id,
        event.org_id,
        payload,
        msg.topic,
        msg.partition,
        msg.offset,
        trace_id,
        event.seq,
        span_id,
    )
    return Decoded(msg, event=event, row=row)


def same_payload(event: EventBase, stored: str) -> bool:
    """Whether ``stored`` (a payload's JSON text as ``event_log`` holds it) is ``event``'s payload once
    both are parsed and validated into the event type's payload model and dumped canonically (JSON
    mode: field order, spacing, number spelling and fields left at their defaults do not count).
    A stored payload that no longer validates is compared as parsed JSON."""
    mine = event.payload
    try:
        theirs = type(mine).model_validate_json(stored)
    except Exception:  # noqa: BLE001 -- validated by an older version of the contract
        return bool(orjson.loads(stored) == orjson.loads(mine.model_dump_json(exclude_unset=True)))
    return bool(theirs.model_dump(mode="json") == mine.model_dump(mode="json"))


def conflicting_duplicates(session: Session, duplicates: Sequence[Decoded]) -> list[Decoded]:
    """Among records whose ``event_id`` was already stored (before or earlier in this batch), those
    whose body differs from the stored event's, as dead letters ``conflicting_duplicate`` naming the
    differing columns. Payloads are compared as parsed events (:func:`same_payload`), not as bytes:
    a re-serialized re-send (other spacing, key order, number spelling) is a duplicate. A duplicate whose event was erased meanwhile is not a conflict. One query, and
    only when there are duplicates.

    Raises:
        psycopg.Error: database faults.
    """
    if not duplicates:
        return []
    stored = stored_bodies(session, [d.event.event_id for d in duplicates])  # type: ignore[union-attr]
    out = []
    for d in duplicates:
        body = stored.get(d.event.event_id.int)  # type: ignore[union-attr]
        if body is None:
            continue
        differ = [
            name
            for name, a, b in zip(BODY_COLUMNS, body, body_of(d.row))  # type: ignore[arg-type]
            if a != b and not (name == "payload" and same_payload(d.event, a))  # type: ignore[arg-type]
        ]
        if differ:
            out.append(
                Decoded(
                    d.msg,
                    reason="conflicting_duplicate",
                    detail=f"event_id {d.event.event_id} is already stored with a different "  # type: ignore[union-attr]
                    f"{', '.join(differ)}; the stored event stays",
                )
            )
    return out

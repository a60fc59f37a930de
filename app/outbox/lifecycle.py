"""Writing lifecycle messages through the transactional outbox.

Invariant: a lifecycle message exists iff the state change it announces committed, because the
``outbox`` row is inserted in the same transaction (the relay in ``app/outbox/relay.py`` publishes
it later). Each message carries a UUIDv7 ``event_id`` fixed at write time, so a re-publish after a
relay crash is recognisable downstream (consumers dedupe on it).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from sqlalchemy.orm import Session
from uuid6 import uuid7

from app.core.settings import get_settings
from app.core.telemetry import inject_headers
from app.models import Outbox

LIFECYCLE_TYPES = (
    "checkpoint.created",
    "checkpoint.promoted",
    "checkpoint.rolled_back",
    "checkpoint.rejected",
    "gate.decided",
    "canary.started",
    "canary.stopped",
)
#: Message types after which serving must move to a new production checkpoint.
PRODUCTION_CHANGES = ("checkpoint.promoted", "checkpoint.rolled_back")
#: Message types after which serving starts or stops routing a fraction of users to a canary.
CANARY_CHANGES = ("canary.started", "canary.stopped")


def enqueue_lifecycle(session: Session, event_type: str, checkpoint_id: str, **fields: Any) -> Outbox:
    """Insert a lifecycle message for ``flywheel.lifecycle`` (the configured lifecycle topic); flush.

    The JSON value is ``{"type", "event_id", "checkpoint_id", "occurred_at", **fields}``; the key is
    ``checkpoint_id``; the current W3C trace context is stored as headers so the relay forwards it.

    Raises:
        ValueError: ``event_type`` is not a lifecycle message type.
    """
    if event_type not in LIFECYCLE_TYPES:
        raise ValueError(f"unknown lifecycle message type {event_type!r}")
    payload = {
        "type": event_type,
        "event_id": str(uuid7()),
        "checkpoint_id": checkpoint_id,
        "occurred_at": datetime.now(UTC).isoformat(),
        **fields,
    }
    headers = [[k, v.decode()] for k, v in inject_headers()]
    row = Outbox(
        topic=get_settings().kafka.lifecycle_topic,
        key=checkpoint_id,
        event_type=event_type,
        payload=payload,
        headers=headers or None,
    )
    session.add(row)
    session.flush()
    return row

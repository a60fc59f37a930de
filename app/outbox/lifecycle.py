"""Writing lifecycle messages through the transactional outbox.

Invariant: a lifecycle message exists iff the state change it announces committed, because the
``outbox`` row is inserted in the same transaction (the relay in ``app/outbox/relay.py`` publishes
it later; the transaction's ``NOTIFY`` on ``OUTBOX_CHANNEL`` wakes it at commit). The message is a typed model (``app.lifecycle.messages``, built by the lifecycle
writers above this package) carrying a UUIDv7 ``event_id`` fixed at write time, so a re-publish
after a relay crash is recognisable downstream (consumers dedupe on it).
"""

from __future__ import annotations

from typing import Any, Protocol

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.settings import get_settings
from app.core.telemetry import inject_headers
from app.models import Outbox
from app.models.events import OUTBOX_CHANNEL


class LifecycleRecord(Protocol):
    """What the outbox needs of a lifecycle message (``app.lifecycle.messages`` models satisfy it)."""

    @property
    def type(self) -> str: ...

    @property
    def checkpoint_id(self) -> str: ...

    def model_dump(self, *, mode: str, exclude: set[str]) -> dict[str, Any]: ...


def enqueue_lifecycle(session: Session, message: LifecycleRecord) -> Outbox:
    """Insert ``message`` for the configured lifecycle topic (``flywheel.lifecycle``); flush.

    The JSON value is the message's fields (``outbox_id`` is left to the relay); the key is its
    ``checkpoint_id``; the current W3C trace context is stored as headers so the relay forwards it.
    """
    headers = [[k, v.decode()] for k, v in inject_headers()]
    row = Outbox(
        topic=get_settings().kafka.lifecycle_topic,
        key=message.checkpoint_id,
        event_type=message.type,
        payload=message.model_dump(mode="json", exclude={"outbox_id"}),
        headers=headers or None,
    )
    session.add(row)
    session.flush()
    # Wakes the relay when (and only if) this transaction commits: the message leaves at once
    # instead of at the relay's next poll.
    session.execute(select(func.pg_notify(OUTBOX_CHANNEL, "")))
    return row

"""Lifecycle messages: the typed records of ``flywheel.lifecycle`` that every follower reads.

Invariants:

- one model per message type, discriminated by ``type``; the writers in ``app.lifecycle`` build
  them (``app.outbox.lifecycle`` stores ``model_dump(mode="json")`` in the caller's transaction),
  and every follower (the serving watcher, its canary follower, the serving front) reads them
  through :func:`parse_lifecycle_message`, so a field renamed on one side breaks a test, not a
  production reload;
- readers are tolerant: unknown fields are ignored (a newer writer may add some), an unknown type
  or a malformed message raises :class:`LifecycleMessageError` for the reader to skip and log;
- ``event_id`` (UUIDv7) and ``occurred_at`` (UTC) are fixed when the model is built, and the relay
  adds ``outbox_id`` (the outbox row's id, the order of changes) when it publishes.

Pydantic only: serving imports this without the database.
"""

from __future__ import annotations

import json
from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError
from uuid6 import uuid7

from app.models.checkpoints import CheckpointStatus, GateVerdict

#: Message types after which serving must move to a new production checkpoint.
PRODUCTION_CHANGES = ("checkpoint.promoted", "checkpoint.rolled_back")
#: Message types after which serving starts or stops routing a fraction of users to a canary.
CANARY_CHANGES = ("canary.started", "canary.stopped")


class LifecycleMessageError(ValueError):
    """A lifecycle message that is not JSON, of an unknown type, or missing a field its type needs."""


def _event_id() -> str:
    return str(uuid7())


def _now() -> datetime:
    return datetime.now(UTC)


class _Message(BaseModel):
    model_config = ConfigDict(extra="ignore", frozen=True)

    event_id: str = Field(default_factory=_event_id)
    """UUIDv7 fixed at write time: a re-published message is recognisable downstream."""
    checkpoint_id: str
    """The checkpoint the change is about (also the Kafka key)."""
    occurred_at: datetime = Field(default_factory=_now)
    """When the change was written (UTC)."""
    actor: str | None = None
    """Who made the change (a token name, ``cli:<user>``, ``trainer``, ``evals:gate``, a policy)."""
    reason: str | None = None
    """The written reason, where the change has one."""
    outbox_id: int | None = None
    """The outbox row's id, added by the relay: later changes have larger ids."""


class LineageEntry(BaseModel):
    """One checkpoint of a lineage and where its directory is."""

    model_config = ConfigDict(extra="ignore", frozen=True)
    id: str
    path: str


class _Serving(_Message):
    """What a follower needs to serve the checkpoint without a database."""

    path: str | None = None
    """The checkpoint's directory."""
    parent_id: str | None = None
    lineage: list[LineageEntry] = Field(default_factory=list)
    """The checkpoint and its ancestors, child first."""


class CheckpointCreated(_Message):
    """A checkpoint was registered (by the trainer as a candidate, or by hand)."""

    type: Literal["checkpoint.created"] = "checkpoint.created"
    parent_id: str | None = None
    path: str
    status: CheckpointStatus = CheckpointStatus.CANDIDATE
    generation: int | None = None
    reward_spec: str | None = None
    num_trajectories: int | None = None
    cycle_id: str | None = None


class GateDecided(_Message):
    """A gate decided on a candidate against production."""

    type: Literal["gate.decided"] = "gate.decided"
    production_id: str
    decision_id: str
    decision: GateVerdict
    passed: bool
    failures: list[str] = Field(default_factory=list)
    report_path: str | None = None


class ProductionChanged(_Serving):
    """Production became ``checkpoint_id`` (a promotion, or a rollback to an earlier production)."""

    type: Literal["checkpoint.promoted", "checkpoint.rolled_back"]
    promotion_id: str | None = None
    previous_production_id: str | None = None
    kind: str | None = None
    """``initial`` for the first production; otherwise absent."""
    gate_decision_id: str | None = None
    gate_decision: GateVerdict | None = None
    override_reason: str | None = None


class CheckpointRejected(_Message):
    """A release manager took a checkpoint out of the running."""

    type: Literal["checkpoint.rejected"] = "checkpoint.rejected"
    previous_status: CheckpointStatus


class ErasureFlagged(_Message):
    """A checkpoint was found trained on erased data (or descends from one): it may not serve."""

    type: Literal["checkpoint.erasure_flagged"] = "checkpoint.erasure_flagged"
    cause: str | None = None
    inherited_from: str | None = None


class CanaryStarted(_Serving):
    """``fraction`` of users (sticky by user hash) are served ``checkpoint_id`` beside production."""

    type: Literal["canary.started"] = "canary.started"
    canary_id: str
    fraction: float = Field(gt=0.0, lt=1.0)
    production_id: str
    gate_decision_id: str | None = None


class CanaryStopped(_Message):
    """The canary ended: production serves every user again."""

    type: Literal["canary.stopped"] = "canary.stopped"
    canary_id: str
    production_id: str | None = None


LifecycleMessage = Annotated[
    CheckpointCreated
    | GateDecided
    | ProductionChanged
    | CheckpointRejected
    | ErasureFlagged
    | CanaryStarted
    | CanaryStopped,
    Field(discriminator="type"),
]
LIFECYCLE_TYPES: tuple[str, ...] = (
    "checkpoint.created",
    "gate.decided",
    *PRODUCTION_CHANGES,
    "checkpoint.rejected",
    "checkpoint.erasure_flagged",
    *CANARY_CHANGES,
)
_ADAPTER: TypeAdapter[LifecycleMessage] = TypeAdapter(LifecycleMessage)


def parse_lifecycle_message(raw: bytes | str | dict[str, Any]) -> LifecycleMessage:
    """The typed message of a lifecycle record (the Kafka value's bytes, its text, or its JSON).

    Raises:
        LifecycleMessageError: not JSON, not an object, an unknown ``type``, no ``event_id`` or
            ``occurred_at``, or a field missing or of the wrong type; the message says which.
    """
    if isinstance(raw, bytes | str):
        try:
            raw = json.loads(raw)
        except (TypeError, ValueError) as exc:
            raise LifecycleMessageError(f"not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise LifecycleMessageError(f"not a JSON object but {type(raw).__name__}")
    if raw.get("type") not in LIFECYCLE_TYPES:
        raise LifecycleMessageError(f"unknown lifecycle message type {raw.get('type')!r}")
    missing = [k for k in ("event_id", "occurred_at") if k not in raw]  # fixed by the writer, never made up here
    if missing:
        raise LifecycleMessageError(f"{raw['type']} without {', '.join(missing)}")
    try:
        return _ADAPTER.validate_python(raw)
    except ValidationError as exc:
        raise LifecycleMessageError(f"invalid {raw['type']}: {exc}") from None

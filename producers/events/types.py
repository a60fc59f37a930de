"""The editor-interaction events: a frozen envelope per type with a typed payload.

Names are past tense (``model.responded``). Every type carries ``schema_version``; a consumer that
meets a version it does not know dead-letters the event rather than guessing. Adding an optional
field keeps the version; removing or retyping a field bumps it.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import TYPE_CHECKING, Annotated, Any, Literal, Union, get_args
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, field_validator, model_validator
from uuid6 import uuid7

from producers.events.packing import LogProbs, TokenIds
from producers.events.plausibility import (
    MAX_COUNT,
    MAX_DELAY_S,
    MAX_LATENCY_S,
    MAX_LAYERS,
    MAX_TOP_K,
    MAX_TURN_INDEX,
    MAX_VOCAB_SIZE,
    check_model_turn,
)


class _Frozen(BaseModel):
    # val_json_bytes: packed token arrays (producers.events.packing) arrive base64-encoded in JSON
    model_config = ConfigDict(frozen=True, extra="forbid", allow_inf_nan=False, val_json_bytes="base64")


class ToolCall(_Frozen):
    """A tool call the model made in one response."""

    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64, description="read_file | edit_file | search | run | finish | ...")
    arguments: dict[str, Any] = Field(default_factory=dict)
    valid: bool = Field(default=True, description="False when the call failed to parse or validate")


# ---- payloads -------------------------------------------------------------------------------


class SessionStarted(_Frozen):
    """An agent session opened in the editor on a task (repository + request)."""

    task_id: str = Field(min_length=1, max_length=256)
    task_source: str = Field(default="product", max_length=64, description="e.g. dataframebench, humaneval, product")
    checkpoint_id: str = Field(min_length=1, max_length=128, description="checkpoint serving the session")
    client: str = Field(default="editor", max_length=64)


class AgentRequested(_Frozen):
    """The developer asked the agent for something (the terse request)."""

    request_id: str = Field(min_length=1, max_length=128)
    text: str = Field(max_length=100_000)


class ModelResponded(_Frozen):
    """One model turn, with everything RL needs from the serving side.

    ``prompt_token_ids`` are only the tokens appended to the context since the previous turn of the
    same segment (the first turn of a segment carries its whole prompt), so the segment's token
    sequence is the concatenation ``prompt_0 + completion_0 + prompt_1 + completion_1 + ...``.
    ``completion_logprobs[i]`` is log pi_behaviour(completion_token_ids[i] | prefix) in nats.
    ``routed_experts`` (MoE only) is a flat ``int32`` array of shape
    ``[len(completion_token_ids), routed_experts_shape[0], routed_experts_shape[1]]`` (layers, top-k);
    entry ``i`` is the experts at the position whose output sampled token ``i``.

    Physically plausible only (``producers.events.plausibility.check_model_turn``, error type
    ``implausible``): at least one completion token; every log-prob finite and <= 0 (within
    float32 rounding); every token id in ``[0, vocab_size)`` (``MAX_VOCAB_SIZE`` when the producer
    does not send ``vocab_size``); expert ids in ``[0, MAX_EXPERTS)``.
    """

    request_id: str = Field(min_length=1, max_length=128)
    segment_index: int = Field(ge=0)
    turn_index: int = Field(ge=0, le=MAX_TURN_INDEX)
    checkpoint_id: str = Field(min_length=1, max_length=128)
    prompt_token_ids: TokenIds
    completion_token_ids: TokenIds
    completion_logprobs: LogProbs
    latency_s: float = Field(ge=0, le=MAX_LATENCY_S, description="wall-clock seconds from request to last token")
    tool_calls: tuple[ToolCall, ...] = ()
    finish_reason: str = Field(default="stop", max_length=32)
    routed_experts: TokenIds | None = None
    routed_experts_shape: (
        tuple[Annotated[int, Field(ge=1, le=MAX_LAYERS)], Annotated[int, Field(ge=1, le=MAX_TOP_K)]] | None
    ) = None
    vocab_size: int | None = Field(
        default=None,
        ge=1,
        le=MAX_VOCAB_SIZE,
        description="vocabulary size of the serving checkpoint (token ids must be below it); optional",
    )
    serving_dtype: Literal["bfloat16", "float16", "float32"] | None = Field(
        default=None,
        description="dtype the serving engine computed completion_logprobs in (bf16 serving against an "
        "fp32 trainer is a known mismatch the trainer's importance ratio corrects); optional",
    )

    @model_validator(mode="after")
    def _lengths_agree(self) -> "ModelResponded":
        if len(self.completion_logprobs) != len(self.completion_token_ids):
            raise ValueError(
                f"completion_logprobs has {len(self.completion_logprobs)} entries for "
                f"{len(self.completion_token_ids)} completion tokens"
            )
        if (self.routed_experts is None) != (self.routed_experts_shape is None):
            raise ValueError("routed_experts and routed_experts_shape go together")
        if self.routed_experts is not None and self.routed_experts_shape is not None:
            layers, k = self.routed_experts_shape
            if len(self.routed_experts) != len(self.completion_token_ids) * layers * k:
                raise ValueError("routed_experts length != completion tokens x layers x top-k")
        check_model_turn(
            self.prompt_token_ids,
            self.completion_token_ids,
            self.completion_logprobs,
            self.vocab_size or MAX_VOCAB_SIZE,
            self.routed_experts,
        )
        return self


class ToolExecuted(_Frozen):
    """The harness ran a tool call and got an observation."""

    call_id: str = Field(min_length=1, max_length=128)
    name: str = Field(min_length=1, max_length=64)
    ok: bool
    exit_code: int | None = None
    output: str = Field(default="", max_length=200_000, description="observation shown to the model (truncated)")
    duration_s: float = Field(default=0.0, ge=0, le=MAX_LATENCY_S)
    ran_tests: bool = Field(default=False, description="the command ran the task's tests")
    command: str | None = Field(default=None, max_length=10_000)
    sandbox_denials: int = Field(
        default=0,
        ge=0,
        le=MAX_COUNT,
        description="attempts of the command the sandbox refused (outside its folder, network)",
    )


class EditProposed(_Frozen):
    """The agent proposed an edit to a file."""

    edit_id: str = Field(min_length=1, max_length=128)
    path: str = Field(min_length=1, max_length=1024)
    lines_added: int = Field(default=0, ge=0, le=MAX_COUNT)
    lines_removed: int = Field(default=0, ge=0, le=MAX_COUNT)
    diff: str = Field(default="", max_length=500_000)


class EditAccepted(_Frozen):
    """The developer accepted a proposed edit."""

    edit_id: str = Field(min_length=1, max_length=128)


class EditRejected(_Frozen):
    """The developer rejected a proposed edit."""

    edit_id: str = Field(min_length=1, max_length=128)


class EditPersistenceMeasured(_Frozen):
    """Some time after acceptance, the fraction of the edit still present in the file."""

    edit_id: str = Field(min_length=1, max_length=128)
    fraction_persisted: float = Field(ge=0.0, le=1.0)
    delay_s: float = Field(ge=0, le=MAX_DELAY_S, description="seconds between acceptance and measurement")


class FollowupSent(_Frozen):
    """The developer sent a follow-up message; ``dissatisfied`` marks a complaint/redo request."""

    text: str = Field(default="", max_length=100_000)
    dissatisfied: bool = False


class ContextSummarized(_Frozen):
    """Self-summarization boundary: the context restarted from a summary; a new segment begins."""

    new_segment_index: int = Field(ge=1)
    summary: str = Field(default="", max_length=100_000)
    summarized_tokens: int = Field(
        default=0, ge=0, le=MAX_COUNT, description="tokens of context replaced by the summary"
    )


class SessionEnded(_Frozen):
    """The session closed. ``expected_signals`` tells the consumer which late signals may follow."""

    reason: str = Field(default="finished", max_length=64, description="finished | budget | turns | error | abandoned")
    turns: int = Field(default=0, ge=0, le=MAX_TURN_INDEX)
    ran_tests: bool = False
    expected_signals: tuple[str, ...] = Field(
        default=(), description="event types still to come for this session, e.g. edit.persistence_measured"
    )


class UserErasureRequested(_Frozen):
    """Right to erasure: delete the envelope's ``user_id``'s events and trajectories."""

    request_id: str = Field(min_length=1, max_length=128)
    reason: str = Field(default="", max_length=1000)


# ---- envelope ------------------------------------------------------------------------------


def _now() -> datetime:
    return datetime.now(UTC)


class EventBase(_Frozen):
    """The envelope every event shares.

    ``event_id`` is a UUIDv7 (time-ordered) and the idempotency key end to end. ``seq`` (optional)
    is the event's position in its session as the producer emitted it, 0 for the first: the
    consumer finds a session's lost events by the gaps. An event without it is encoded without
    the field (a consumer that predates it reads the event as before).
    """

    event_id: UUID = Field(default_factory=uuid7)
    type: str
    schema_version: Literal[1] = Field(
        default=1, description="a type that changes incompatibly overrides this with its new version"
    )
    occurred_at: AwareDatetime = Field(default_factory=_now)
    session_id: str = Field(min_length=1, max_length=128)
    user_id: str = Field(min_length=1, max_length=128, description="pseudonymous")
    org_id: str = Field(default="default", min_length=1, max_length=128)
    privacy_mode: bool = False
    seq: int | None = Field(
        default=None,
        ge=0,
        le=2**31 - 1,
        exclude_if=lambda v: v is None,
        description="position in the session as emitted (0 first), assigned by the producer SDK; optional",
    )
    if TYPE_CHECKING:
        # Each envelope declares its payload's model; code that dispatched on ``type`` reads it.
        payload: Any

    @field_validator("occurred_at")
    @classmethod
    def _utc(cls, v: datetime) -> datetime:
        return v.astimezone(UTC)


class SessionStartedEvent(EventBase):
    type: Literal["session.started"] = "session.started"
    payload: SessionStarted


class AgentRequestedEvent(EventBase):
    type: Literal["agent.requested"] = "agent.requested"
    payload: AgentRequested


class ModelRespondedEvent(EventBase):
    type: Literal["model.responded"] = "model.responded"
    payload: ModelResponded


class ToolExecutedEvent(EventBase):
    type: Literal["tool.executed"] = "tool.executed"
    payload: ToolExecuted


class EditProposedEvent(EventBase):
    type: Literal["edit.proposed"] = "edit.proposed"
    payload: EditProposed


class EditAcceptedEvent(EventBase):
    type: Literal["edit.accepted"] = "edit.accepted"
    payload: EditAccepted


class EditRejectedEvent(EventBase):
    type: Literal["edit.rejected"] = "edit.rejected"
    payload: EditRejected


class EditPersistenceMeasuredEvent(EventBase):
    type: Literal["edit.persistence_measured"] = "edit.persistence_measured"
    payload: EditPersistenceMeasured


class FollowupSentEvent(EventBase):
    type: Literal["followup.sent"] = "followup.sent"
    payload: FollowupSent


class ContextSummarizedEvent(EventBase):
    type: Literal["context.summarized"] = "context.summarized"
    payload: ContextSummarized


class SessionEndedEvent(EventBase):
    type: Literal["session.ended"] = "session.ended"
    payload: SessionEnded


class UserErasureRequestedEvent(EventBase):
    type: Literal["user.erasure_requested"] = "user.erasure_requested"
    payload: UserErasureRequested


Event = Annotated[
    Union[
        SessionStartedEvent,
        AgentRequestedEvent,
        ModelRespondedEvent,
        ToolExecutedEvent,
        EditProposedEvent,
        EditAcceptedEvent,
        EditRejectedEvent,
        EditPersistenceMeasuredEvent,
        FollowupSentEvent,
        ContextSummarizedEvent,
        SessionEndedEvent,
        UserErasureRequestedEvent,
    ],
    Field(discriminator="type"),
]
"""Any editor-interaction event (discriminated on ``type``); its members are every envelope class."""

ENVELOPES: tuple[type[EventBase], ...] = get_args(get_args(Event)[0])
"""Every event type's envelope class, in the order of the contract's JSON Schema."""

EVENT_CLASSES: dict[str, type[EventBase]] = {cls.model_fields["type"].default: cls for cls in ENVELOPES}
"""Event type -> envelope class."""

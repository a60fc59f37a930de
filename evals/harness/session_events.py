"""The event contract of one agent session: building each event and handing it on.

The agent loop (:mod:`evals.harness.agent`) says what happened; :class:`SessionEvents` turns it into
the contract's events (``producers.events.types``), each carrying the session's envelope, records
it, and passes it to ``emit`` at once.

Invariants: ``events`` holds every event in the order the session produced it, and ``emit`` (when
given) receives the same events in the same order, each before the next is built. ``session.ended``
is produced once: later calls of :meth:`SessionEvents.session_ended` do nothing. An event whose
payload is invalid raises ``pydantic.ValidationError`` before it is recorded or emitted.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from app.inference.engine import Generation
from producers.events.types import (
    AgentRequested,
    AgentRequestedEvent,
    ContextSummarized,
    ContextSummarizedEvent,
    EditProposed,
    EditProposedEvent,
    EventBase,
    ModelResponded,
    ModelRespondedEvent,
    SessionEnded,
    SessionEndedEvent,
    SessionStarted,
    SessionStartedEvent,
    ToolCall,
    ToolExecuted,
    ToolExecutedEvent,
)

REQUEST_ID = "r0"  # the id of a session's first developer request; its follow-ups are r1, r2, ...


class SessionEvents:
    """The events of one session, recorded and emitted.

    Args:
        envelope: the fields every event carries (``session_id``, ``user_id``, ``org_id``,
            ``privacy_mode``).
        emit: receives every event (``EventProducer.emit`` in the simulator); None records only.
    """

    def __init__(self, envelope: dict[str, Any], emit: Callable[[EventBase], None] | None) -> None:
        self.envelope = envelope
        self._emit = emit
        self.events: list[EventBase] = []
        self._ended = False
        self._requests = 0
        self.request_id = REQUEST_ID
        """The request the model is answering (``r<k>`` for the ``k``-th ``agent.requested``)."""

    def emit(self, event: EventBase) -> None:
        """Record ``event`` and pass it to ``emit``."""
        self.events.append(event)
        if self._emit is not None:
            self._emit(event)

    def session_started(self, task_id: str, task_source: str, checkpoint_id: str) -> None:
        """``session.started`` for the task the session works on, served by ``checkpoint_id``."""
        self.emit(
            SessionStartedEvent(
                **self.envelope,
                payload=SessionStarted(task_id=task_id, task_source=task_source, checkpoint_id=checkpoint_id),
            )
        )

    def agent_requested(self, text: str) -> None:
        """``agent.requested``: the developer's request ``text`` (the next request of the session;
        the model's turns after it answer it)."""
        self.request_id = f"r{self._requests}"
        self._requests += 1
        self.emit(AgentRequestedEvent(**self.envelope, payload=AgentRequested(request_id=self.request_id, text=text)))

    def model_responded(
        self,
        *,
        segment_index: int,
        turn_index: int,
        checkpoint_id: str,
        prompt_token_ids: list[int],
        generation: Generation,
        tool_calls: tuple[ToolCall, ...],
    ) -> None:
        """``model.responded`` for one turn: ``prompt_token_ids`` are the tokens appended since the
        segment's previous turn, ``generation`` the completion with its behaviour log-probs (nats)
        and, for MoE, its routes (``[T][layers][top_k]``, sent flat with their shape)."""
        experts = {}
        if generation.routed_experts:
            layers, k = len(generation.routed_experts[0]), len(generation.routed_experts[0][0])
            experts = dict(
                routed_experts=[e for tok in generation.routed_experts for layer in tok for e in layer],
                routed_experts_shape=(layers, k),
            )
        self.emit(
            ModelRespondedEvent(
                **self.envelope,
                payload=ModelResponded(
                    request_id=self.request_id,
                    segment_index=segment_index,
                    turn_index=turn_index,
                    checkpoint_id=checkpoint_id,
                    prompt_token_ids=prompt_token_ids,
                    completion_token_ids=generation.token_ids,
                    completion_logprobs=generation.logprobs,
                    latency_s=generation.latency_s,
                    tool_calls=tool_calls,
                    finish_reason=generation.finish_reason,
                    serving_dtype=generation.dtype,
                    **experts,
                ),
            )
        )

    def tool_executed(self, call_id: str, name: str, ok: bool, output: str, **details: Any) -> None:
        """``tool.executed`` for one call; ``details`` are the optional ``ToolExecuted`` fields
        (``exit_code``, ``duration_s``, ``ran_tests``, ``command``, ``sandbox_denials``)."""
        self.emit(
            ToolExecutedEvent(
                **self.envelope, payload=ToolExecuted(call_id=call_id, name=name, ok=ok, output=output, **details)
            )
        )

    def edit_proposed(self, edit_id: str, edit: dict[str, Any]) -> None:
        """``edit.proposed`` for an edit as ``ToolOutcome.edit`` describes it (``path``,
        ``lines_added``, ``lines_removed``, ``diff``)."""
        self.emit(
            EditProposedEvent(
                **self.envelope,
                payload=EditProposed(
                    edit_id=edit_id,
                    path=edit["path"],
                    lines_added=edit["lines_added"],
                    lines_removed=edit["lines_removed"],
                    diff=edit["diff"],
                ),
            )
        )

    def context_summarized(self, new_segment_index: int, summary: str, summarized_tokens: int) -> None:
        """``context.summarized``: segment ``new_segment_index`` starts from ``summary`` (the first
        100,000 characters are sent), replacing ``summarized_tokens`` tokens of context."""
        self.emit(
            ContextSummarizedEvent(
                **self.envelope,
                payload=ContextSummarized(
                    new_segment_index=new_segment_index, summary=summary[:100_000], summarized_tokens=summarized_tokens
                ),
            )
        )

    def session_ended(self, reason: str, turns: int, ran_tests: bool, expected: tuple[str, ...]) -> None:
        """``session.ended`` the first time it is called; later calls do nothing."""
        if self._ended:
            return
        self._ended = True
        self.emit(
            SessionEndedEvent(
                **self.envelope,
                payload=SessionEnded(reason=reason, turns=turns, ran_tests=ran_tests, expected_signals=expected),
            )
        )

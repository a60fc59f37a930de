"""Trajectory projection: fold stored events, in ``event_log.seq`` order, into trajectory state
(``consumers.trajectory_state``).

Invariants:

- The fold is a pure function of the event sequence and each event's ingestion time (the
  ``event_log.ingested_at`` the live consumer stamped): no wall clock, no randomness. Folding a
  session's events in one go (replay) or batch by batch with the state stored in between (live)
  gives identical rows, and the trajectory id is ``uuid5(session_id)``.
- Segments: ``model.responded.segment_index`` names the segment (a ``context.summarized`` event opens
  segment ``new_segment_index``). A segment's ``token_ids`` are ``prompt_0 + completion_0 + prompt_1 +
  completion_1 + ...`` exactly as served, ``loss_mask`` is 1 on completion tokens, and
  ``behaviour_logprobs`` carries the serving policy's log-probs there (0 elsewhere).
- MoE routes: ``routed_experts`` holds the serving experts of every completion token of the segment,
  in order (``app.repositories.trajectories.pack_routes``), or nothing: a turn without routes, or
  with another ``[layers, top_k]`` shape, empties them for the whole segment (the trainer then routes
  those tokens itself), and a segment that has completion tokens without routes never starts them.
- Late signals (decision): a trajectory is finalized when every signal ``session.ended`` said to
  expect has arrived, or when its window closes (``signal_window_s`` after ``session.ended``, by the
  ingestion clock; ``abandon_after_s`` after the last event if the session never ended). An event
  ingested after the close is late: it stays in ``event_log`` and its id is recorded in
  ``late_event_ids``, but the finalized trajectory and its labels do not change (the trainer may
  already have used them). ``flywheel relabel`` folds every stored event, late ones included.
  Because the close is judged against ``ingested_at``, a batch that meets a late event finalizes
  the trajectory first, exactly as the periodic sweep would have; the sweep only materializes it.
- Incomplete sessions (``consumers.trajectory_state.incomplete_reason``: no ``session.started``, or
  a gap in the producer's per-session ``seq``) are never finalized by their signals: they are held
  until the window closes (a missing event may still arrive, from another partition or a re-read
  log), and, still incomplete then, finalized with ``incomplete_reason`` set: the trainer never
  selects them (``trainer.selection``, reason ``incomplete``).
"""

from __future__ import annotations

import hashlib
import uuid
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, NamedTuple

from app.repositories.trajectories import pack_routes
from consumers.rewards.difficulty import TaskHistory
from consumers.rewards.math import RewardResult, compute_reward, inputs_from_signals
from consumers.rewards.spec import RewardSpec
from consumers.trajectory_state import SegmentState, TrajectoryState, incomplete_reason
from producers.events.types import EventBase

TOOL_OUTPUT_CHARS = 2000
"""Characters of a tool observation kept in ``tool_results`` (the tokens hold all of it)."""


def reserved_for_eval(task_id: str | None, fraction: float) -> bool:
    """Whether a task's trajectories are held out for evals: sha256(task_id) below ``fraction``."""
    if not task_id or fraction <= 0:
        return False
    h = int.from_bytes(hashlib.sha256(task_id.encode()).digest()[:8], "big")
    return h / 2**64 < fraction


class StoredEvent(NamedTuple):
    """An event as stored in ``event_log`` (or about to be): where and when it was ingested."""

    event: EventBase
    seq: int
    ingested_at: datetime
    topic: str | None = None
    partition: int | None = None
    offset: int | None = None


@dataclass(frozen=True)
class ProjectionConfig:
    """What the fold needs from settings (seconds)."""

    signal_window_s: float = 3600.0
    abandon_after_s: float = 86_400.0
    eval_reserve_fraction: float = 0.0
    relabel: bool = False
    """Relabel mode: fold every event (no finalization, no late rule, no token arrays)."""


SegmentLoader = Callable[[uuid.UUID, int], "SegmentState | None"]


class Projector:
    """Folds events into :class:`TrajectoryState` and finalizes with the active reward specs.

    ``load_segment(trajectory_id, index)`` fetches a stored segment the fold needs but the caller did
    not preload (rare: out-of-order turns); it returns None for a segment that does not exist.
    """

    def __init__(
        self, config: ProjectionConfig, specs: list[RewardSpec], load_segment: SegmentLoader | None = None
    ) -> None:
        self.config = config
        self.specs = specs
        self.load_segment = load_segment or (lambda _tid, _idx: None)
        self._handlers = {
            name[4:].replace("_", ".", 1): getattr(self, name) for name in dir(self) if name.startswith("_on_")
        }

    # ---- finalization ---------------------------------------------------------------------

    def finalize(self, t: TrajectoryState, at: datetime, by: str) -> None:
        """Mark ``t`` finalized at ``at`` (``signals`` | ``window`` | ``abandoned``), say whether its
        events are incomplete (``incomplete_reason``) and label it."""
        t.status, t.finalized_at, t.finalized_by, t.dirty = "finalized", at, by, True
        t.incomplete_reason = incomplete_reason(t)
        t.labels = self.label(t)

    def label(self, t: TrajectoryState, task_history: TaskHistory = TaskHistory()) -> list[RewardResult]:
        """One reward per spec from the trajectory's signals and, for a spec that reads it, its task's
        history (``flywheel relabel`` passes it; finalization labels only specs that do not read it)."""
        inputs = inputs_from_signals(t.signals, t.completion_tokens, task_history)
        return [compute_reward(spec, inputs) for spec in self.specs]

    def close_if_due(self, t: TrajectoryState, now: datetime) -> bool:
        """Finalize by window if its close is at or before ``now`` (ingestion clock). True if it did."""
        if t.status == "provisional" and t.window_closes_at is not None and now > t.window_closes_at:
            self.finalize(t, t.window_closes_at, "window" if t.ended_at is not None else "abandoned")
            return True
        return False

    # ---- folding --------------------------------------------------------------------------

    def apply(self, t: TrajectoryState, se: StoredEvent) -> None:
        """Fold one stored event into ``t`` (events must come in ``seq`` order)."""
        ev = se.event
        if not self.config.relabel:
            self.close_if_due(t, se.ingested_at)
            if t.status == "finalized":
                t.late_event_ids.append(ev.event_id)
                t.dirty = True
                return
        t.dirty = True
        t.event_ids.append(ev.event_id)
        t.max_event_seq = se.seq if t.max_event_seq is None else max(t.max_event_seq, se.seq)
        if ev.seq is not None:
            t.producer_seq_count += 1
            t.producer_seq_max = ev.seq if t.producer_seq_max is None else max(t.producer_seq_max, ev.seq)
        if t.last_event_at is None or ev.occurred_at > t.last_event_at:
            t.last_event_at = ev.occurred_at
        if t.ended_at is not None and ev.type != "session.ended":
            after = t.signals["received_after_end"]
            after[ev.type] = after.get(ev.type, 0) + 1
        handler = self._handlers.get(ev.type)
        if handler is not None:
            handler(t, se)
        if self.config.relabel:
            return
        if t.ended_at is None:
            t.window_closes_at = se.ingested_at + timedelta(seconds=self.config.abandon_after_s)
        elif self._expected_arrived(t) and incomplete_reason(t) is None:  # an incomplete one waits for its window
            self.finalize(t, se.ingested_at, "signals")

    @staticmethod
    def _expected_arrived(t: TrajectoryState) -> bool:
        need = Counter(t.expected_signals)
        got = t.signals["received_after_end"]
        return all(got.get(k, 0) >= n for k, n in need.items())

    def _segment(self, t: TrajectoryState, index: int) -> SegmentState:
        seg = t.segments.get(index)
        if seg is None:
            seg = None if self.config.relabel else self.load_segment(t.id, index)
            if seg is None:
                seg = SegmentState(segment_index=index)
                t.num_segments += 1
            t.segments[index] = seg
        seg.dirty = True
        return seg

    @staticmethod
    def _lineage(seg: SegmentState, se: StoredEvent) -> None:
        seg.event_ids.append(se.event.event_id)
        if se.topic is not None and se.partition is not None and se.offset is not None:
            key = f"{se.topic}:{se.partition}"
            seg.min_offset[key] = min(seg.min_offset.get(key, se.offset), se.offset)
            seg.max_offset[key] = max(seg.max_offset.get(key, se.offset), se.offset)

    def _on_session_started(self, t: TrajectoryState, se: StoredEvent) -> None:
        p = se.event.payload
        t.task_id, t.task_source, t.checkpoint_id = p.task_id, p.task_source, p.checkpoint_id
        t.started_at = se.event.occurred_at
        t.reserved_for_eval = reserved_for_eval(p.task_id, self.config.eval_reserve_fraction)

    def _on_agent_requested(self, t: TrajectoryState, se: StoredEvent) -> None:
        if t.request_text is None:
            t.request_text = se.event.payload.text

    def _on_model_responded(self, t: TrajectoryState, se: StoredEvent) -> None:
        p = se.event.payload
        n_prompt, n_completion = len(p.prompt_token_ids), len(p.completion_token_ids)
        t.num_turns += 1
        t.completion_tokens += n_completion
        s = t.signals
        s["latency_s"] = s["latency_s"] + p.latency_s
        s["tool_calls"] += len(p.tool_calls)
        s["invalid_tool_calls"] += sum(1 for c in p.tool_calls if not c.valid)
        if self.config.relabel:
            return
        seg = self._segment(t, p.segment_index)
        self._lineage(seg, se)
        seg.turn_token_offsets.append(seg.num_tokens)
        seg.turn_checkpoint_ids.append(p.checkpoint_id)
        if seg.checkpoint_id is None:
            seg.checkpoint_id = p.checkpoint_id
        # The arrays arrive packed (producers.events.packing): their bytes are the segment's, as sent.
        seg.token_ids += p.prompt_token_ids.raw
        seg.token_ids += p.completion_token_ids.raw
        seg.loss_mask += bytes(n_prompt) + b"\x01" * n_completion
        seg.behaviour_logprobs += bytes(4 * n_prompt)
        seg.behaviour_logprobs += p.completion_logprobs.raw
        self._routes(seg, p)
        seg.num_tokens += n_prompt + n_completion
        seg.num_completion_tokens += n_completion
        seg.num_turns += 1
        for c in p.tool_calls:
            seg.tool_calls.append(
                {
                    "turn_index": p.turn_index,
                    "call_id": c.call_id,
                    "name": c.name,
                    "arguments": c.arguments,
                    "valid": c.valid,
                }
            )

    @staticmethod
    def _routes(seg: SegmentState, p: Any) -> None:
        """Append a ``model.responded`` payload's routed experts to ``seg`` (called before the turn's
        completion tokens are counted in ``num_completion_tokens``)."""
        if not p.completion_token_ids:
            return
        shape = None if p.routed_experts_shape is None else list(p.routed_experts_shape)
        if shape is None or (seg.num_completion_tokens and seg.routed_experts_shape != shape):
            seg.routed_experts, seg.routed_experts_shape, seg.routed_experts_itemsize = bytearray(), None, None
            return
        raw, size = pack_routes(seg.routed_experts, seg.routed_experts_itemsize, p.routed_experts.numpy())
        seg.routed_experts, seg.routed_experts_shape, seg.routed_experts_itemsize = bytearray(raw), shape, size

    def _on_tool_executed(self, t: TrajectoryState, se: StoredEvent) -> None:
        p = se.event.payload
        s = t.signals
        s["tool_errors"] += 0 if p.ok else 1
        if p.ran_tests:
            t.ran_tests = True
            s["test_runs"] += 1
            s["last_test_passed"] = bool(p.ok and (p.exit_code or 0) == 0)
            if p.command and p.command not in t.test_commands:
                t.test_commands.append(p.command)
        if self.config.relabel:
            return
        index = self._segment_of_call(t, p.call_id)
        seg = self._segment(t, index)
        self._lineage(seg, se)
        seg.tool_results.append(
            {
                "call_id": p.call_id,
                "name": p.name,
                "ok": p.ok,
                "exit_code": p.exit_code,
                "duration_s": p.duration_s,
                "ran_tests": p.ran_tests,
                "output": p.output[:TOOL_OUTPUT_CHARS],
                "output_chars": len(p.output),
            }
        )

    @staticmethod
    def _segment_of_call(t: TrajectoryState, call_id: str) -> int:
        """The loaded segment whose turn made ``call_id`` (newest first: it is nearly always the
        last call of the open segment), else the newest segment."""
        for i in sorted(t.segments, reverse=True):
            for c in reversed(t.segments[i].tool_calls):
                if c["call_id"] == call_id:
                    return i
        return max(t.segments, default=0)

    def _edit(self, t: TrajectoryState, edit_id: str) -> dict[str, Any]:
        edit: dict[str, Any] = t.signals["edits"].setdefault(
            edit_id, {"proposed": False, "lines_added": 0, "lines_removed": 0, "decision": None, "persisted": None}
        )
        return edit

    def _on_edit_proposed(self, t: TrajectoryState, se: StoredEvent) -> None:
        p = se.event.payload
        e = self._edit(t, p.edit_id)
        e.update(proposed=True, lines_added=p.lines_added, lines_removed=p.lines_removed, path=p.path)

    def _on_edit_accepted(self, t: TrajectoryState, se: StoredEvent) -> None:
        self._edit(t, se.event.payload.edit_id)["decision"] = "accepted"

    def _on_edit_rejected(self, t: TrajectoryState, se: StoredEvent) -> None:
        self._edit(t, se.event.payload.edit_id)["decision"] = "rejected"

    def _on_edit_persistence_measured(self, t: TrajectoryState, se: StoredEvent) -> None:
        self._edit(t, se.event.payload.edit_id)["persisted"] = se.event.payload.fraction_persisted

    def _on_followup_sent(self, t: TrajectoryState, se: StoredEvent) -> None:
        t.signals["followups"] += 1
        t.signals["dissatisfied_followups"] += 1 if se.event.payload.dissatisfied else 0

    def _on_context_summarized(self, t: TrajectoryState, se: StoredEvent) -> None:
        t.signals["summaries"] += 1
        if not self.config.relabel:
            self._lineage(self._segment(t, se.event.payload.new_segment_index), se)

    def _on_session_ended(self, t: TrajectoryState, se: StoredEvent) -> None:
        if t.ended_at is not None:  # a repeated end changes nothing but lineage
            return
        p = se.event.payload
        t.ended_at, t.end_reason = se.event.occurred_at, p.reason
        t.ran_tests = t.ran_tests or p.ran_tests
        t.expected_signals = list(p.expected_signals)
        t.signals["received_after_end"] = {}
        t.window_closes_at = se.ingested_at + timedelta(seconds=self.config.signal_window_s)

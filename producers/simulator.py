"""The editor simulator: plays the product backend and its developers (``flywheel simulate``).

It runs agent sessions with the production checkpoint on training-split tasks through the SAME
harness evals use, and sends every event through ``EventProducer`` with the real token ids and
behaviour log-probs. After each session a simulated developer reacts:

- edits are accepted when the agent finished its work (rejected otherwise, with ``reject_rate``);
- the task's hidden tests decide whether accepted edits persist: ``edit.persistence_measured``
  follows ``persistence_delay_s`` later with the share of the edit's added lines still in the file
  when the tests pass, and a small remainder (the developer rewrote it) when they fail;
- a failing session brings a dissatisfied ``followup.sent`` with probability ``followup_rate``;
- ``privacy_rate`` of the sessions run in privacy mode.

Invariants: ``session.ended.expected_signals`` lists exactly the late events that will follow
(one entry per event), and those are emitted (the run waits for the last delay before closing
the producer). Sessions on one task form a group (``group_size``) and run concurrently, their
model calls batched together, so the trainer gets groups and the CPU is used well.
"""

from __future__ import annotations

import heapq
import logging
import math
import random
import shutil
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

from opentelemetry import context as otel_context
from pydantic import BaseModel, ConfigDict, Field

from app.core.telemetry import tracer

from app.events.types import (
    EditAccepted, EditAcceptedEvent, EditPersistenceMeasured, EditPersistenceMeasuredEvent, EditRejected,
    EditRejectedEvent, EventBase, FollowupSent, FollowupSentEvent,
)

log = logging.getLogger(__name__)
_tracer = tracer("flywheel.producers.simulator")

FOLLOWUPS = ("This doesn't work, the tests still fail.", "That broke it. Please redo this.",
             "No, that's not what I asked for.")


class SimulatorConfig(BaseModel):
    """Settings of one simulator run (the CLI flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sessions: int = Field(default=8, ge=1)
    """Agent sessions to run."""
    tasks: int | None = Field(default=None, ge=1)
    """Distinct tasks (default: sessions / group_size, rounded up)."""
    group_size: int = Field(default=4, ge=1)
    """Sessions per task, run concurrently (the trainer's groups)."""
    source: str = "dataframebench"
    """Task source (training split only)."""
    split: str = "train"
    """Split of the source; never an eval split."""
    max_turns: int = Field(default=6, ge=1)
    """Model turns per session."""
    max_tokens: int = Field(default=1024, ge=16)
    """Completion tokens per session."""
    max_tokens_per_turn: int = Field(default=256, ge=8)
    """Completion tokens per turn."""
    context_tokens: int = Field(default=3072, ge=256)
    """Context kept before self-summarization (tokens)."""
    temperature: float = Field(default=0.7, ge=0.0)
    """Sampling temperature of the behaviour policy (recorded log-probs are of this distribution).
    Keep it equal to the trainer's ``loss.temperature`` (trainer/configs/default.toml): the trainer
    evaluates ``softmax(logits / T)`` against these log-probs."""
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    """Nucleus mass."""
    privacy_rate: float = Field(default=0.1, ge=0.0, le=1.0)
    """Share of sessions in privacy mode."""
    followup_rate: float = Field(default=0.6, ge=0.0, le=1.0)
    """Probability of a dissatisfied follow-up after a session whose edit fails the hidden tests."""
    reject_rate: float = Field(default=0.5, ge=0.0, le=1.0)
    """Probability an edit of an unfinished session (budget/turns) is rejected."""
    persistence_delay_s: float = Field(default=5.0, ge=0.0)
    """Seconds between acceptance and ``edit.persistence_measured``."""
    followup_delay_s: float = Field(default=2.0, ge=0.0)
    """Seconds between the end of a session and its follow-up."""
    users: int = Field(default=16, ge=1)
    """Distinct pseudonymous users."""
    org_id: str = "default"
    """Organisation of every session."""
    seed: int = 0
    """Seeds task choice, users, privacy, developer reactions and sampling."""
    run_timeout_s: float = Field(default=60.0, gt=0)
    """Wall-clock limit of one ``run`` tool call and of the hidden tests (seconds)."""


class DeveloperReaction:
    """What the simulated developer does after one session; builds the late events."""

    def __init__(self, config: SimulatorConfig, rng: random.Random, task, workdir: Path, envelope: dict,
                 emit: Callable[[EventBase], None], schedule: Callable[[float, EventBase], None]) -> None:
        self.config, self.rng, self.task, self.workdir = config, rng, task, workdir
        self.envelope, self.emit, self.schedule = envelope, emit, schedule
        self.passed: bool | None = None
        self.grade_detail: dict | None = None

    def __call__(self, result) -> list[str]:
        """``on_end`` hook: grade, accept/reject edits now, schedule late signals, return their types."""
        from evals.harness.agent import grade_result
        from evals.harness.sandbox import SandboxLimits

        self.passed = False
        if result.edited:
            graded = grade_result(self.task, self.workdir, SandboxLimits(timeout_s=self.config.run_timeout_s))
            self.passed = graded.ok
            self.grade_detail = {"exit_code": graded.exit_code, "killed_reason": graded.killed_reason,
                                 "duration_s": round(graded.duration_s, 2), "tail": graded.stderr[-300:]}
        expected: list[str] = []
        final = result.final_files
        for edit in result.edits:
            rejected = result.reason != "finished" and self.rng.random() < self.config.reject_rate
            if rejected:
                self.emit(EditRejectedEvent(**self.envelope, payload=EditRejected(edit_id=edit["edit_id"])))
                continue
            self.emit(EditAcceptedEvent(**self.envelope, payload=EditAccepted(edit_id=edit["edit_id"])))
            fraction = surviving_fraction(edit, final.get(edit["path"], ""))
            if not self.passed:  # the developer rewrites the failing code; a little of it survives
                fraction *= self.rng.uniform(0.0, 0.3)
            delay = self.config.persistence_delay_s
            self.schedule(delay, EditPersistenceMeasuredEvent(**self.envelope, payload=EditPersistenceMeasured(
                edit_id=edit["edit_id"], fraction_persisted=round(min(max(fraction, 0.0), 1.0), 4), delay_s=delay)))
            expected.append("edit.persistence_measured")
        if not self.passed and self.rng.random() < self.config.followup_rate:
            self.schedule(self.config.followup_delay_s, FollowupSentEvent(**self.envelope, payload=FollowupSent(
                text=self.rng.choice(FOLLOWUPS), dissatisfied=True)))
            expected.append("followup.sent")
        return expected


def surviving_fraction(edit: dict, final_text: str) -> float:
    """Share of the edit's added lines still present in the file at the end of the session."""
    added = [ln for ln in edit.get("added", []) if ln.strip()]
    if not added:
        return 1.0
    remaining = set(final_text.splitlines())
    return sum(1 for ln in added if ln in remaining) / len(added)


class LateEvents:
    """Late signals due at a wall-clock time, emitted by the simulator loop as they fall due."""

    def __init__(self, emit: Callable[[EventBase], None]) -> None:
        self._emit, self._heap, self._lock, self._n = emit, [], threading.Lock(), 0

    def schedule(self, delay_s: float, event: EventBase) -> None:
        """Emit ``event`` after ``delay_s`` seconds, inside the trace context current now (the
        session's span), so a session's late signals join its trace."""
        ctx = otel_context.get_current()
        with self._lock:
            self._n += 1
            heapq.heappush(self._heap, (time.monotonic() + delay_s, self._n, event, ctx))

    def emit_due(self, *, wait_all: bool = False) -> int:
        """Emit events that are due (all of them, sleeping as needed, when ``wait_all``)."""
        sent = 0
        while True:
            with self._lock:
                if not self._heap:
                    return sent
                due, _, event, ctx = self._heap[0]
                now = time.monotonic()
                if due > now and not wait_all:
                    return sent
                if due <= now:
                    heapq.heappop(self._heap)
            if due > now:
                time.sleep(min(due - now, 1.0))
                continue
            # The event's occurred_at is its emission time (the measurement happens now).
            token = otel_context.attach(ctx)
            try:
                self._emit(event.model_copy(update={"occurred_at": datetime.now(timezone.utc)}))
            finally:
                otel_context.detach(token)
            sent += 1


def run_simulation(config: SimulatorConfig, engine, emit: Callable[[EventBase], None],
                   progress: Callable[[dict], None] | None = None,
                   engine_for: Callable[[str], object] | None = None) -> list[dict]:
    """Run ``config.sessions`` sessions; returns one summary dict per session.

    ``engine_for(user_id)`` picks the engine that serves a user's session (a canary split,
    ``ops.serving.canary.EngineRouter.engine_for``); default: ``engine`` for everyone. Each engine
    gets its own micro-batcher, so a batch never mixes two checkpoints.

    Raises:
        ConfigurationError: an eval-only split or unknown source.
    """
    from app.core.errors import ConfigurationError
    from evals.harness.agent import AgentBudget, run_agent_session
    from evals.harness.sandbox import SandboxLimits
    from evals.tasks import load_tasks
    from ops.serving.batching import BatchingEngine
    from ops.serving.engine import SamplingParams

    if config.split != "train":
        raise ConfigurationError(f"the simulator plays product sessions on training tasks only (got split "
                                 f"{config.split!r}); eval splits never reach the event stream")
    rng = random.Random(config.seed)
    n_tasks = config.tasks or math.ceil(config.sessions / config.group_size)
    tasks = load_tasks(config.source, config.split, limit=n_tasks, seed=config.seed)
    plan = [tasks[(i // config.group_size) % len(tasks)] for i in range(config.sessions)]
    late = LateEvents(emit)
    budget = AgentBudget(max_turns=config.max_turns, max_completion_tokens=config.max_tokens,
                         context_tokens=config.context_tokens, max_tokens_per_turn=config.max_tokens_per_turn)
    limits = SandboxLimits(timeout_s=config.run_timeout_s)
    batchers: dict[int, BatchingEngine] = {}

    def batcher_for(user_id: str) -> BatchingEngine:
        chosen = engine_for(user_id) if engine_for is not None else engine
        if id(chosen) not in batchers:
            batchers[id(chosen)] = BatchingEngine(chosen, max_batch=config.group_size, window_s=0.2,
                                                  expected=config.group_size)
        return batchers[id(chosen)]
    summaries: list[dict] = []
    root = Path(tempfile.mkdtemp(prefix="flywheel-sim-"))
    try:
        for start in range(0, len(plan), config.group_size):
            group = plan[start:start + config.group_size]
            specs = []
            for offset, task in enumerate(group):
                i = start + offset
                user_id = f"user-{rng.randrange(config.users):03d}"
                specs.append(dict(index=i, task=task, session_id=f"sim-{uuid.uuid4()}", user_id=user_id,
                                  privacy=rng.random() < config.privacy_rate, rng=random.Random(rng.random()),
                                  seed=config.seed * 100_003 + i, batcher=batcher_for(user_id)))
            remaining = {id(s["batcher"]): 0 for s in specs}
            for s in specs:
                remaining[id(s["batcher"])] += 1
            lock = threading.Lock()

            def one(spec: dict) -> None:
                workdir = root / spec["session_id"]
                envelope = dict(session_id=spec["session_id"], user_id=spec["user_id"], org_id=config.org_id,
                                privacy_mode=spec["privacy"])
                dev = DeveloperReaction(config, spec["rng"], spec["task"], workdir, envelope, emit, late.schedule)
                started = time.perf_counter()
                # One trace per session: the producer injects this span's context into every event's
                # headers, and the consumer links its batch spans to it.
                with _tracer.start_as_current_span("simulator.session", attributes={
                        "flywheel.session_id": spec["session_id"], "flywheel.task_id": spec["task"].id}):
                    summary = _run_one(spec, workdir, dev, started)
                with lock:
                    summaries.append(summary)
                if progress:
                    progress(summary)

            def _run_one(spec: dict, workdir: Path, dev: "DeveloperReaction", started: float) -> dict:
                try:
                    result = run_agent_session(
                        spec["batcher"], spec["task"], workdir, budget,
                        SamplingParams(max_tokens=config.max_tokens_per_turn, temperature=config.temperature,
                                       top_p=config.top_p, seed=spec["seed"]),
                        emit=emit, session_id=spec["session_id"], user_id=spec["user_id"], org_id=config.org_id,
                        privacy_mode=spec["privacy"], limits=limits, on_end=dev)
                    summary = {"session": spec["index"], "session_id": spec["session_id"], "task_id": spec["task"].id,
                               "user_id": spec["user_id"], "checkpoint_id": spec["batcher"].checkpoint_id,
                               "reason": result.reason, "turns": result.turns, "segments": result.segments,
                               "completion_tokens": result.completion_tokens, "tool_calls": result.tool_calls,
                               "tool_call_errors": result.tool_call_errors, "edited": result.edited,
                               "passed": dev.passed, "grade": dev.grade_detail, "privacy_mode": spec["privacy"],
                               "wall_s": round(time.perf_counter() - started, 1)}
                except Exception as exc:  # one broken session must not stop the others (it emitted its end)
                    log.exception("session %s failed", spec["session_id"])
                    summary = {"session": spec["index"], "session_id": spec["session_id"], "error": repr(exc)}
                finally:
                    shutil.rmtree(workdir, ignore_errors=True)
                    with lock:
                        remaining[id(spec["batcher"])] -= 1
                        spec["batcher"].set_expected(remaining[id(spec["batcher"])])
                return summary

            for s in specs:
                s["batcher"].set_expected(remaining[id(s["batcher"])])
            threads = [threading.Thread(target=one, args=(s,), name=f"session-{s['index']}") for s in specs]
            for t in threads:
                t.start()
            for t in threads:
                while t.is_alive():
                    t.join(timeout=0.5)
                    late.emit_due()
        late.emit_due(wait_all=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sorted(summaries, key=lambda s: s["session"])

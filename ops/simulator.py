"""The editor simulator: plays the product backend and its developers (``flywheel simulate``).

It runs agent sessions with the production checkpoint on training-split tasks through the SAME
harness evals use, and sends every event through ``EventProducer`` with the real token ids and
behaviour log-probs. After each session a simulated developer reacts to what it can see
(:class:`ops.developer.DeveloperModel`, seeded): whether the edited file passes a visible check (it parses and
defines the requested function), and whether the task's hidden tests pass (what the developer
finds out by using the code). Acceptance, edit persistence and dissatisfied follow-ups are drawn
from those outcomes with the model's probabilities; serving latency is modelled from the engine's
own measured per-token prefill and decode times, so it follows the tokens the policy spent and not
the load of a shared CPU.

Invariants: ``session.ended.expected_signals`` lists exactly the late events that will follow
(one entry per event), and those are emitted (the run waits for the last delay before closing
the producer). Sessions on one task form a group (``group_size``, the trainer's GRPO groups); all
sessions run concurrently (at most ``concurrency`` in flight), so one engine batches every
session's model calls. A share of the groups (``long_session_share``, default none) plays long
``functions_long`` sessions, with the turns it takes them to self-summarize.

Size: over 400 lines because the plan (which tasks at which request mix, in which groups) and its
play (each session's turns, the developer's reaction and the events each emits, in the order the
product backend emits them) are one recipe read top to bottom; the developer model
(:mod:`ops.developer`) and the CLI (:mod:`ops.simulator_cli`) live beside it.
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
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from opentelemetry import context as otel_context
from pydantic import BaseModel, ConfigDict, Field

from app.core.errors import ConfigurationError
from app.core.telemetry import tracer
from app.inference.engine import SamplingParams
from evals.config import source_packages
from evals.harness.agent import AgentBudget, run_agent_session
from evals.harness.sandbox import SandboxLimits
from evals.tasks import load_tasks
from evals.tasks.model import Task
from ops.developer import DeveloperModel, DeveloperReaction
from producers.events.types import (
    EventBase,
)

log = logging.getLogger(__name__)
_tracer = tracer("flywheel.producers.simulator")


PRODUCTION_MIX: dict[int, float] = {1: 0.6, 2: 0.3, 3: 0.1}
"""The production request mix of the in-reach ``functions`` source by difficulty level
(docs/simulator.md): mostly one-expression requests, which the base model solves about a quarter of
the time at the serving temperature; levels 2 and 3 it almost never solves. The demo's and the
bench's simulated traffic and ``flywheel ab``'s fresh draw follow it."""

LONG_SESSION_SOURCE = "functions_long"
"""Where long sessions come from (``SimulatorConfig.long_session_share``): multi-step requests in
long files, whose sessions self-summarize (docs/tasks.md)."""
LONG_SESSION_MIN_TURNS = 4
"""The fewest model turns that take a ``functions_long`` session into its second segment: two
answers, then the summary turn (the third request no longer fits the 3,072-token context), then
the third answer, the first turn of the new segment (docs/tasks.md, "Long sessions")."""


class SimulatorConfig(BaseModel):
    """Settings of one simulator run (the CLI flags)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    sessions: int = Field(default=8, ge=1)
    """Agent sessions to run."""
    tasks: int | None = Field(default=None, ge=1)
    """Distinct tasks (default: sessions / group_size, rounded up)."""
    group_size: int = Field(default=4, ge=1)
    """Sessions per task (the trainer's groups)."""
    concurrency: int = Field(default=64, ge=1)
    """Sessions in flight at once (their model calls batch together in the engine)."""
    source: str = "dataframebench"
    """Task source (training split only)."""
    split: str = "train"
    """Split of the source; never an eval split."""
    difficulty_mix: dict[int, float] | None = None
    """The request mix: relative weight of each task difficulty level (tasks whose metadata has a
    ``difficulty``, e.g. ``functions``: 1, 2, 3) when choosing the run's tasks; None, or a source
    without difficulty levels: a uniform seeded subset."""
    max_turns: int = Field(default=6, ge=1)
    """Model turns per session (a long session's: at least :data:`LONG_SESSION_MIN_TURNS`)."""
    max_tokens: int = Field(default=1024, ge=16)
    """Completion tokens per session (a long session's: at least :data:`LONG_SESSION_MIN_TURNS` x
    ``max_tokens_per_turn``)."""
    long_session_share: float = Field(default=0.0, ge=0.0, le=1.0)
    """Share of the run's task groups played on :data:`LONG_SESSION_SOURCE` train tasks instead of
    ``source`` (whole groups; :func:`plan_sessions` says how many and which); 0: none."""
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
    developer: DeveloperModel = DeveloperModel()
    """How the simulated developers react to outcomes."""
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


class LateEvents:
    """Late signals due at a wall-clock time, emitted by the simulator loop as they fall due."""

    def __init__(self, emit: Callable[[EventBase], None]) -> None:
        self._emit, self._lock, self._n = emit, threading.Lock(), 0
        self._heap: list[tuple[float, int, EventBase, otel_context.Context]] = []

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
                self._emit(event.model_copy(update={"occurred_at": datetime.now(UTC)}))
            finally:
                otel_context.detach(token)
            sent += 1


class ModelledLatency:
    """An engine wrapper whose generations report modelled serving latency instead of wall time.

    ``latency_s = prefill_tokens * prefill_s_per_token + len(token_ids) * decode_s_per_token``,
    with the per-token seconds an engine measured on itself unloaded, where it reports them. On a shared
    CPU the wall time of a batched request mostly measures the other requests and the machine's load;
    the modelled figure follows only what this policy did (how much it read and wrote). An engine that
    reports neither keeps its own latency: a server's wall clock, or the reference engine's, which
    counts from the start of the request's own completion (one prompt at a time, the wait excluded).
    """

    def __init__(self, engine) -> None:
        self.engine = engine
        self.decode_s = getattr(engine, "decode_s_per_token", None)
        self.prefill_s = getattr(engine, "prefill_s_per_token", None) or 0.0

    def __getattr__(self, name: str):
        return getattr(self.engine, name)

    def generate(self, prompts: list[list[int]], params) -> list:
        """The wrapped engine's generations with ``latency_s`` modelled (seconds)."""
        out = self.engine.generate(prompts, params)
        if self.decode_s is None:
            return out
        for prompt, gen in zip(prompts, out):
            prefill = getattr(gen, "prefill_tokens", 0) or len(prompt)
            gen.latency_s = prefill * self.prefill_s + len(gen.token_ids) * self.decode_s
        return out


def choose_tasks(tasks: list, n: int, mix: dict[int, float], seed: int) -> list:
    """``n`` distinct tasks drawn without replacement, each pick's difficulty level drawn with the
    weights of ``mix`` among the levels that still have tasks (levels absent from ``mix`` weigh 0).
    Tasks without a ``difficulty`` in their metadata count as one level, ``None``, of weight 1 when
    no task has one (a uniform subset). Seeded; returned in pick order.

    Raises:
        ConfigurationError: a negative weight, or no task with positive weight.
    """
    if any(w < 0 for w in mix.values()):
        raise ConfigurationError(f"difficulty weights must be >= 0, got {mix}")
    rng = random.Random(seed)
    pools: dict[int | None, list] = {}
    for task in sorted(tasks, key=lambda t: t.id):
        pools.setdefault(task.metadata.get("difficulty"), []).append(task)
    weights = {level: (mix.get(level, 0.0) if level is not None else 1.0) for level in pools}
    if list(pools) == [None]:
        weights = {None: 1.0}
    if not any(w > 0 for w in weights.values()):
        raise ConfigurationError(f"no task has a difficulty level weighted above 0 by {mix}")
    chosen: list[Any] = []
    while len(chosen) < n:
        levels = [lv for lv, pool in pools.items() if pool and weights[lv] > 0]
        if not levels:
            break
        level = rng.choices(levels, weights=[weights[lv] for lv in levels])[0]
        chosen.append(pools[level].pop(rng.randrange(len(pools[level]))))
    return chosen


@dataclass(frozen=True)
class SessionSpec:
    """One planned session: its task, who plays it, the seeds and the turn and token budget it runs with."""

    index: int
    task: Task
    session_id: str
    user_id: str
    privacy: bool
    rng: random.Random
    seed: int
    engine: ModelledLatency
    max_turns: int
    max_tokens: int


def long_groups(config: SimulatorConfig) -> list[int]:
    """Indices of the run's task groups played on :data:`LONG_SESSION_SOURCE`, ascending.

    Of the run's ``ceil(sessions / group_size)`` groups, ``round(long_session_share x groups)``
    (halves up), and at least one when the share is above 0, chosen without replacement by a
    stream seeded from ``config.seed`` apart from the plan's own stream (so the users, privacy
    modes and seeds of every session are those of the same run without long sessions).
    """
    if config.long_session_share <= 0:
        return []
    n_groups = math.ceil(config.sessions / config.group_size)
    n_long = min(n_groups, max(1, math.floor(config.long_session_share * n_groups + 0.5)))
    return sorted(random.Random(f"{config.seed}/long-sessions").sample(range(n_groups), n_long))


def plan_sessions(
    config: SimulatorConfig, engine, engine_for: Callable[[str], object] | None = None
) -> list[SessionSpec]:
    """The sessions of a run, in order: ``config.group_size`` consecutive sessions share a task,
    users and privacy mode drawn from ``config.seed``; each session's client is chosen as
    :func:`run_simulation` says.

    The groups :func:`long_groups` names play distinct ``functions_long`` train tasks (a seeded
    subset; reused in turn past its 53), ``max_turns`` raised to :data:`LONG_SESSION_MIN_TURNS` and
    ``max_tokens`` to that many turns of ``max_tokens_per_turn`` where lower; every other group
    plays the task of ``config.source`` it plays without long sessions. With ``long_session_share = 0``
    the plan is the one of the simulator before the setting existed (same draws, same order).

    Raises:
        ConfigurationError: an eval-only split or unknown source.
    """
    if config.split != "train":
        raise ConfigurationError(
            f"the simulator plays product sessions on training tasks only (got split "
            f"{config.split!r}); eval splits never reach the event stream"
        )
    rng = random.Random(config.seed)
    n_tasks = config.tasks or math.ceil(config.sessions / config.group_size)
    if config.difficulty_mix:
        tasks = choose_tasks(load_tasks(config.source, config.split), n_tasks, config.difficulty_mix, config.seed)
    else:
        tasks = load_tasks(config.source, config.split, limit=n_tasks, seed=config.seed)
    long = long_groups(config)
    long_tasks = load_tasks(LONG_SESSION_SOURCE, "train", limit=len(long), seed=config.seed) if long else []
    long_turns = max(config.max_turns, LONG_SESSION_MIN_TURNS)
    long_tokens = max(config.max_tokens, LONG_SESSION_MIN_TURNS * config.max_tokens_per_turn)

    def engine_of(user_id: str) -> ModelledLatency:
        if engine_for is not None:
            return ModelledLatency(engine_for(user_id))
        for_user = getattr(engine, "for_user", None)
        return ModelledLatency(for_user(user_id) if for_user is not None else engine)

    specs = []
    for i in range(config.sessions):
        user_id = f"user-{rng.randrange(config.users):03d}"
        group = i // config.group_size
        is_long = group in long
        specs.append(
            SessionSpec(
                index=i,
                task=long_tasks[long.index(group) % len(long_tasks)] if is_long else tasks[group % len(tasks)],
                session_id=f"sim-{uuid.uuid4()}",
                user_id=user_id,
                privacy=rng.random() < config.privacy_rate,
                rng=random.Random(rng.random()),
                seed=config.seed * 100_003 + i,
                engine=engine_of(user_id),
                max_turns=long_turns if is_long else config.max_turns,
                max_tokens=long_tokens if is_long else config.max_tokens,
            )
        )
    return specs


def play_session(
    config: SimulatorConfig, spec: SessionSpec, root: Path, emit: Callable[[EventBase], None], late: LateEvents
) -> dict:
    """Play one session through the agent harness, the simulated developer reacting at its end;
    returns its summary (``error`` instead when the session raised: one broken session must not
    stop the others, and it emitted its end)."""
    workdir = root / spec.session_id
    envelope = dict(session_id=spec.session_id, user_id=spec.user_id, org_id=config.org_id, privacy_mode=spec.privacy)
    dev = DeveloperReaction(config, spec.rng, spec.task, workdir, envelope, emit, late.schedule)
    budget = AgentBudget(
        max_turns=spec.max_turns,
        max_completion_tokens=spec.max_tokens,
        context_tokens=config.context_tokens,
        max_tokens_per_turn=config.max_tokens_per_turn,
    )
    sampling = SamplingParams(
        max_tokens=config.max_tokens_per_turn, temperature=config.temperature, top_p=config.top_p, seed=spec.seed
    )
    started = time.perf_counter()
    # One trace per session: the producer injects this span's context into every event's
    # headers, and the consumer links its batch spans to it.
    with _tracer.start_as_current_span(
        "simulator.session",
        attributes={"flywheel.session_id": spec.session_id, "flywheel.task_id": spec.task.id},
    ):
        try:
            result = run_agent_session(
                spec.engine,  # type: ignore[arg-type]  # forwards the wrapped engine's interface
                spec.task,
                workdir,
                budget,
                sampling,
                emit=emit,
                session_id=spec.session_id,
                user_id=spec.user_id,
                org_id=config.org_id,
                privacy_mode=spec.privacy,
                limits=SandboxLimits(timeout_s=config.run_timeout_s, packages=source_packages(config.source)),
                on_end=dev,
            )
        except Exception as exc:
            log.exception("session %s failed", spec.session_id)
            return {"session": spec.index, "session_id": spec.session_id, "error": repr(exc)}
        finally:
            shutil.rmtree(workdir, ignore_errors=True)
    return {
        "session": spec.index,
        "session_id": spec.session_id,
        "task_id": spec.task.id,
        "user_id": spec.user_id,
        "checkpoint_id": spec.engine.checkpoint_id,
        "reason": result.reason,
        "turns": result.turns,
        "segments": result.segments,
        "completion_tokens": result.completion_tokens,
        "latency_s": round(result.latency_s, 3),
        "tool_calls": result.tool_calls,
        "tool_call_errors": result.tool_call_errors,
        "edited": result.edited,
        "outcome": dev.outcome,
        "passed": dev.passed,
        "accepted": dev.accepted,
        "rejected": dev.rejected,
        "grade": dev.grade_detail,
        "privacy_mode": spec.privacy,
        "wall_s": round(time.perf_counter() - started, 1),
    }


def run_simulation(
    config: SimulatorConfig,
    engine,
    emit: Callable[[EventBase], None],
    progress: Callable[[dict], None] | None = None,
    engine_for: Callable[[str], object] | None = None,
) -> list[dict]:
    """Run ``config.sessions`` sessions, at most ``config.concurrency`` at once; returns one summary
    dict per session, ordered by session index. Each session gets its own client of ``engine``
    where the engine offers one per user (``OpenAICompatEngine.for_user``, the serving front's
    client: the front routes the user to production or the canary and stamps the checkpoint that
    served, which the session's events then carry); else ``engine`` itself.
    ``engine_for(user_id)`` overrides that choice (tests and benches that hold both engines).

    Raises:
        ConfigurationError: an eval-only split or unknown source.
    """
    specs = plan_sessions(config, engine, engine_for)
    late = LateEvents(emit)
    root = Path(tempfile.mkdtemp(prefix="flywheel-sim-"))
    summaries: list[dict] = []
    try:
        with ThreadPoolExecutor(max_workers=min(config.concurrency, len(specs)), thread_name_prefix="session") as pool:
            pending = {pool.submit(play_session, config, spec, root, emit, late) for spec in specs}
            while pending:
                finished, pending = wait(pending, timeout=0.5, return_when=FIRST_COMPLETED)
                for fut in finished:
                    summaries.append(fut.result())
                    if progress:
                        progress(summaries[-1])
                late.emit_due()
        late.emit_due(wait_all=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    return sorted(summaries, key=lambda s: s["session"])

"""Serving follows production: consume ``checkpoint.promoted`` / ``checkpoint.rolled_back`` from the
lifecycle topic and move the inference engine to the new production checkpoint; with a
``serving.canary.CanaryFollower`` attached, also start and stop the canary engine on
``canary.started`` / ``canary.stopped`` (on vLLM without ``FLYWHEEL_SERVING_CANARY_URL``: the managed
``canary`` server, started for the canary and stopped after it; a canary that cannot be served is
logged as an error and the watcher goes on). Traffic is split by the serving front
(:mod:`serving.front`), which routes a canary's users only to a server reporting its checkpoint.

Invariants:

- Every message is applied at most once: the outbox relay is at-least-once (a crash between publish
  and mark re-publishes), so messages are deduplicated on their ``event_id`` and ignored when their
  ``outbox_id`` is not newer than the last production change applied (production changes are
  serialised in Postgres, so their outbox ids grow in commit order).
- Only the newest production change of a poll batch is acted on: after a restart or a lag the
  engine jumps straight to the current production instead of replaying history.
- The engine moves by a full reload of the target's STABLE directory (:mod:`serving.moves`); every
  move is logged with its method and counted in the ``flywheel.serving.weight_moves`` metric
  (attribute ``method``: ``full`` or ``noop``).
- What serves (production, and the canary when one runs) is reported in ``$FLYWHEEL_HOME/serving.json``
  (atomic replace), together with the Kafka positions and the dedupe state, so a restarted watcher
  resumes where it stopped.
- A partition whose log ends below the position read to was re-created (a restarted in-memory
  broker): it is read again from its start, so no production change published there is skipped.

With a managed vLLM production server (:mod:`serving.vllm_server`) the watcher also supervises it:
every 10 s it checks the server's health and restarts a dead or hung one on the checkpoint it
served, logging an error; requests made while it is down fail loudly in their clients.

Every serving replica runs its own watcher over ALL partitions (manual assignment, not a consumer
group): each replica must see every production change. The topic is read by the follower the
serving front uses too (:mod:`serving.lifecycle_topic`).
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path

from app.checkpoints.store import CheckpointStore
from app.core.db import session_scope
from app.core.errors import CheckpointError, InfrastructureError
from app.core.metrics import SERVING_RELOAD_DURATION
from app.core.retry import is_transient
from app.core.settings import flywheel_home, get_settings
from app.core.telemetry import extract_context, meter, tracer
from app.lifecycle.messages import CanaryStarted, CanaryStopped, LifecycleMessage, ProductionChanged
from app.lifecycle.serving_state import read_serving_state, write_serving_state
from app.models import Checkpoint
from app.repositories.checkpoints import get_production
from serving.canary import CanaryFollower, EngineRouter
from serving.engine import setup_engine
from serving.lifecycle_topic import LifecycleBatch, LifecycleTopicFollower
from serving.moves import Engine, Move, plan_move
from serving.openai_engine import OpenAICompatEngine
from serving.reconcile import reconcile_served
from serving.vllm_server import VLLMServer, ensure_server

log = logging.getLogger("flywheel.watcher")
_moves = meter("flywheel.serving").create_counter(
    "flywheel.serving.weight_moves",
    unit="{move}",
    description="production weight changes applied by the serving watcher, by method (full | noop)",
)

SEEN_IDS_KEPT = 512


def message_identity(message: LifecycleMessage, headers: Iterable[tuple[str, bytes]] | None = None) -> str:
    """The stable id of a lifecycle message: its ``event_id`` (fixed by the writer, checked by the
    parser; the relay's ``outbox-id`` header says the same row)."""
    return message.event_id


class Deduper:
    """Remembers the last ``capacity`` message ids seen (insertion order, oldest evicted)."""

    def __init__(self, seen: Sequence[str] = (), capacity: int = SEEN_IDS_KEPT) -> None:
        self.capacity = capacity
        self._seen: dict[str, None] = dict.fromkeys(list(seen)[-capacity:])

    def seen(self, message_id: str | None) -> bool:
        """Whether an id was recorded (None never was)."""
        return message_id is not None and message_id in self._seen

    def add(self, message_id: str | None) -> None:
        """Record an id (evicting the oldest beyond ``capacity``)."""
        if message_id is None or message_id in self._seen:
            return
        self._seen[message_id] = None
        while len(self._seen) > self.capacity:
            self._seen.pop(next(iter(self._seen)))

    def first_time(self, message_id: str | None) -> bool:
        """True the first time an id is seen (ids of None always pass); records it."""
        if self.seen(message_id):
            return False
        self.add(message_id)
        return True

    def ids(self) -> list[str]:
        """The remembered ids, oldest first."""
        return list(self._seen)


class ProductionFollower:
    """Applies production changes to an engine and reports what serves (no Kafka here).

    Args:
        engine: the inference engine to move.
        store: where checkpoints live when a message's paths do not resolve.
        home: directory of ``serving.json`` (default ``$FLYWHEEL_HOME``).
        canary: follows canary changes too (its canary, if ``serving.json`` names one, is rebuilt).
    """

    def __init__(
        self,
        engine: Engine,
        *,
        store: CheckpointStore | None = None,
        home: Path | None = None,
        canary: CanaryFollower | None = None,
    ) -> None:
        self.engine = engine
        self.store = store or CheckpointStore.from_settings()
        self.home = home
        state = read_serving_state(home) or {}
        self.deduper = Deduper(state.get("seen_event_ids", []))
        self.applied_outbox_id: int = int(state.get("applied_outbox_id") or 0)
        self.offsets: dict[str, int] = dict(state.get("offsets") or {})
        self.moves: list[Move] = []
        self.canary = canary
        if canary is not None:
            canary.restore(state)

    def accept(self, message: LifecycleMessage, headers: Iterable[tuple[str, bytes]] | None = None) -> bool:
        """Whether a message is a production change not applied before and newer than the applied one
        (nothing is recorded: a batch whose move fails is accepted again when it is re-read)."""
        if not isinstance(message, ProductionChanged) or self.deduper.seen(message_identity(message, headers)):
            return False
        return not (message.outbox_id is not None and message.outbox_id <= self.applied_outbox_id)

    def apply(self, message: ProductionChanged) -> Move:
        """Move the engine to the message's checkpoint and report it.

        Raises:
            CheckpointError: the target is not available on this node (the caller retries later).
        """
        started = time.perf_counter()
        move = plan_move(getattr(self.engine, "checkpoint_id", None), message, self.store)
        if move.method == "full" and move.path is not None:
            self.engine.load_checkpoint(move.target_id, move.path)
        if message.outbox_id is not None:
            self.applied_outbox_id = max(self.applied_outbox_id, message.outbox_id)
        self.deduper.add(message_identity(message))
        self.moves.append(move)
        how = {"noop": "already served", "full": "by a full reload"}[move.method]
        log.info("serving %s %s, after %s", move.target_id, how, message.type)
        _moves.add(1, {"method": move.method})
        SERVING_RELOAD_DURATION.record(time.perf_counter() - started, {"method": move.method})
        self.report(last_event=message, method=move.method)
        return move

    def handle_batch(
        self, messages: Sequence[tuple[LifecycleMessage, Sequence[tuple[str, bytes]] | None]]
    ) -> Move | None:
        """Apply only the newest accepted production change of a batch (see module docstring), then
        the newest canary change when a canary follower is attached. Returns the production move."""
        accepted = [(m, h) for m, h in messages if isinstance(m, ProductionChanged) and self.accept(m, h)]
        move = None
        if accepted:
            newest, headers = max(accepted, key=lambda mh: mh[0].outbox_id or 0)
            # a child of the promotion (or rollback) span whose context the lifecycle message carries
            with tracer("flywheel.serving").start_as_current_span(
                "serving.reload",
                context=extract_context(headers),
                attributes={"flywheel.checkpoint_id": newest.checkpoint_id, "flywheel.event": newest.type},
            ) as span:
                move = self.apply(newest)
                span.set_attribute("flywheel.method", move.method)
            for m, h in accepted:  # superseded changes of the batch count as handled too
                self.deduper.add(message_identity(m, h))
            self.report(last_event=newest, method=move.method)
        if self.canary is not None:
            changes = [
                (m, h)
                for m, h in messages
                if isinstance(m, CanaryStarted | CanaryStopped) and not self.deduper.seen(message_identity(m, h))
            ]
            if changes:
                self.canary.handle([c for c, _ in changes])
                for c, h in changes:
                    self.deduper.add(message_identity(c, h))
                self.report()
        return move

    def report(self, *, last_event: LifecycleMessage | None = None, method: str | None = None) -> None:
        """Write ``serving.json``: what serves, how it got there, and the resume state."""
        previous = read_serving_state(self.home) or {}
        write_serving_state(
            {
                "checkpoint_id": getattr(self.engine, "checkpoint_id", None),
                "method": method or previous.get("method"),
                "event_id": last_event.event_id if last_event is not None else previous.get("event_id"),
                "event_type": last_event.type if last_event is not None else previous.get("event_type"),
                "applied_outbox_id": self.applied_outbox_id,
                "seen_event_ids": self.deduper.ids(),
                "offsets": self.offsets,
                **(self.canary.state() if self.canary is not None else {}),
            },
            self.home,
        )


class ServingWatcher:
    """Reads the lifecycle topic through a :class:`serving.lifecycle_topic.LifecycleTopicFollower`
    and feeds a :class:`ProductionFollower`.

    Positions are saved in ``serving.json`` after each batch; with none saved the watcher reads the
    topic from the beginning and jumps to the newest production change it finds.
    """

    def __init__(
        self,
        engine: Engine,
        *,
        bootstrap: str | None = None,
        topic: str | None = None,
        store: CheckpointStore | None = None,
        home: Path | None = None,
        canary: CanaryFollower | None = None,
        supervise: Callable[[], object] | None = None,
        supervise_interval_s: float = 10.0,
    ) -> None:
        kafka = get_settings().kafka
        bootstrap = bootstrap or kafka.bootstrap
        if not bootstrap:
            raise InfrastructureError("no broker configured: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel stack up`")
        self.follower = ProductionFollower(engine, store=store, home=home, canary=canary)
        self.topic_follower = LifecycleTopicFollower(
            self._apply_batch,
            bootstrap=bootstrap,
            topic=topic or kafka.lifecycle_topic,
            client_id="flywheel-serving-watcher",
            start_at="beginning",
            positions={int(p): int(o) for p, o in self.follower.offsets.items()},
            # a checkpoint not synced here yet, or a broker or database fault, clears by itself
            retry=lambda exc: isinstance(exc, CheckpointError) or is_transient(exc),
            before_poll=self.supervise,
        )
        self._last_move: Move | None = None
        self._supervise = supervise
        self._supervise_interval_s = supervise_interval_s
        self._supervised_at = 0.0

    def supervise(self) -> None:
        """Run the supervision hook (a managed server's health check and restart) if it is due; a
        failed restart is logged as an error and tried again at the next interval, never fatal."""
        if self._supervise is None or time.monotonic() - self._supervised_at < self._supervise_interval_s:
            return
        self._supervised_at = time.monotonic()
        try:
            self._supervise()
        except InfrastructureError as exc:
            log.error("the serving engine is down and could not be restarted: %s", exc)

    def _apply_batch(self, batch: LifecycleBatch) -> None:
        self._last_move = self.follower.handle_batch([(r.message, r.headers) for r in batch.records])
        self.follower.offsets.update({str(p): o for p, o in batch.positions.items()})
        self.follower.report()

    def poll_once(self, timeout_ms: int = 1000) -> Move | None:
        """Poll one batch, apply its newest production change, save positions. Returns the move made.

        Raises:
            CheckpointError: the target is not available here; positions are not advanced, so the
                batch is read again on the next poll.
            Exception: the broker or the database failed (``kafka.errors.KafkaError``,
                ``sqlalchemy.exc.DBAPIError``...); likewise nothing is advanced.
        """
        self._last_move = None
        self.topic_follower.poll_once(timeout_ms)
        return self._last_move

    def caught_up(self) -> bool:
        """Whether every partition has been read to its current end offset."""
        return self.topic_follower.caught_up()

    def run(self, *, idle_exit: bool = False, poll_ms: int = 1000) -> None:
        """Poll until :meth:`stop` (or, with ``idle_exit``, until the topic is read to its end). A
        checkpoint not available here yet, or a broker or database fault (a restart, a network
        partition), is retried with backoff (1 s doubling, at most 30 s): serving keeps the model it
        has and moves once the fault clears, never skipping a production change.

        Raises:
            Exception: a fault that is not transient (``app.core.retry.is_transient``).
        """
        self.topic_follower.run(idle_exit=idle_exit, poll_ms=poll_ms)

    def start(self) -> threading.Thread:
        """Run in a daemon thread (embed in a serving process that owns the engine)."""
        return self.topic_follower.start("serving-watcher")

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling and close the consumer."""
        self.topic_follower.stop(timeout_s)


def _initial_checkpoint() -> tuple[str | None, Path | None]:
    state = read_serving_state() or {}
    wanted = state.get("checkpoint_id")
    try:
        with session_scope() as session:
            row = session.get(Checkpoint, wanted) if wanted else get_production(session)
            if row is not None:
                return row.id, Path(row.path)
    except Exception as exc:  # no database on this node: serve what the state file says
        log.info("no checkpoint registry reachable (%s)", exc)
    return wanted, None


def run_watch(*, once: bool = False) -> None:
    """``flywheel watch``: build the configured engine on the last served (or production)
    checkpoint, report it, then follow production and canary changes until SIGTERM."""
    checkpoint_id, path = _initial_checkpoint()
    engine = setup_engine(checkpoint_id=checkpoint_id, model_dir=path)
    if isinstance(engine, OpenAICompatEngine):
        # A watcher killed mid-reload (between /pause and /resume) leaves the server holding every
        # request; the move it was making is read again below, but a server already reporting the
        # target would never be resumed by it.
        engine.resume()
    supervise: Callable[[], object] | None = None
    managed = VLLMServer.load(flywheel_home(), "production") is not None
    if managed or isinstance(engine, OpenAICompatEngine):
        store = CheckpointStore.from_settings()

        def reconcile() -> None:
            if managed:  # the stack's own server: restarted when it died
                ensure_server("production")
            if isinstance(engine, OpenAICompatEngine):  # any server: serving what production is
                reconcile_served(engine, store)

        supervise = reconcile

    watcher = ServingWatcher(engine, canary=CanaryFollower(EngineRouter(engine)), supervise=supervise)
    watcher.follower.report()
    signal.signal(signal.SIGTERM, lambda *_: watcher.topic_follower.request_stop())
    try:
        watcher.run(idle_exit=once)
    finally:
        watcher.stop()

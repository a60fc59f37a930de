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
- The engine moves by the delta chain (``delta.zst`` of each checkpoint between the serving one and
  the target) when the target descends from what is served and the engine applies deltas itself
  (the torch engine, ``flywheel serve``); by a full load otherwise (rollbacks, unrelated lineage, a
  missing or failing delta, vLLM, which can only reload a folder). Every move is logged with its
  method and counted in the ``flywheel.serving.weight_moves`` metric (attribute ``method``).
- What serves (production, and the canary when one runs) is reported in ``$FLYWHEEL_HOME/serving.json``
  (atomic replace), together with the Kafka positions and the dedupe state, so a restarted watcher
  resumes where it stopped.
- A partition whose log ends below the position read to was re-created (a restarted in-memory
  broker): it is read again from its start, so no production change published there is skipped.

With a managed vLLM production server (:mod:`serving.vllm_server`) the watcher also supervises it:
every 10 s it checks the server's health and restarts a dead or hung one on the checkpoint it
served, logging an error; requests made while it is down fail loudly in their clients.

Every serving replica runs its own watcher over ALL partitions (manual assignment, not a consumer
group): each replica must see every production change.

Size: over 400 lines because production moves and canary starts and stops share one message loop,
one dedupe of redelivered lifecycle messages and one state file; splitting them would split that loop.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kafka import KafkaConsumer, TopicPartition

from app.checkpoints.delta import DELTA_FILE
from app.checkpoints.store import STABLE, CheckpointStore
from app.core.db import session_scope
from app.core.errors import CheckpointError, InfrastructureError
from app.core.metrics import SERVING_RELOAD_DURATION
from app.core.retry import Backoff, is_transient
from app.core.settings import flywheel_home, get_settings
from app.core.telemetry import extract_context, meter, tracer
from app.lifecycle.messages import PRODUCTION_CHANGES, LifecycleMessageError, parse_lifecycle_message
from app.lifecycle.serving_state import read_serving_state, write_serving_state
from app.models import Checkpoint
from app.repositories.checkpoints import get_production
from producers.settings import kafka_security
from serving.canary import CANARY_CHANGES, CanaryFollower, EngineRouter
from serving.engine import setup_engine
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_server import VLLMServer, ensure_server

log = logging.getLogger("flywheel.watcher")
_moves = meter("flywheel.serving").create_counter(
    "flywheel.serving.weight_moves",
    unit="{move}",
    description="production weight changes applied by the serving watcher, by method (delta | full | noop)",
)

SEEN_IDS_KEPT = 512


class Engine(Protocol):
    """The part of ``app.inference.engine.InferenceEngine`` the watcher drives."""

    checkpoint_id: str

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None: ...

    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None: ...

    # optional: ``applies_deltas`` (default True), False when apply_delta reloads the full folder


@dataclass(frozen=True)
class Move:
    """How the engine gets from the serving checkpoint to the target."""

    target_id: str
    method: str  # "noop" | "delta" | "full"
    steps: tuple[tuple[str, Path, str], ...] = ()  # (checkpoint_id, delta path, parent id), parent first
    path: Path | None = None  # full-load directory


def message_identity(payload: dict[str, Any], headers: Iterable[tuple[str, bytes]] | None = None) -> str | None:
    """The stable id of a lifecycle message: its ``event_id`` (else the ``outbox-id`` header)."""
    if payload.get("event_id"):
        return str(payload["event_id"])
    for k, v in headers or ():
        if k in ("event-id", "outbox-id") and v:
            return f"{k}:{v.decode()}"
    return None


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


def _resolve_dir(entry_path: str | None, checkpoint_id: str, store: CheckpointStore) -> Path:
    if entry_path and (Path(entry_path) / STABLE).exists():
        return Path(entry_path)
    return store.stable_path(checkpoint_id)


def plan_move(serving_id: str | None, payload: dict[str, Any], store: CheckpointStore, *, deltas: bool = True) -> Move:
    """The cheapest way from ``serving_id`` to the message's checkpoint.

    ``payload["lineage"]`` lists ``{"id", "path"}`` from the target back to the base (written by
    ``app.promotion.service``). Delta steps are returned parent first. ``deltas=False`` (an engine
    that cannot apply them, e.g. vLLM) plans a full load of the target instead.

    Raises:
        CheckpointError: the target directory is missing or not STABLE.
    """
    target = payload["checkpoint_id"]
    if serving_id == target:
        return Move(target_id=target, method="noop")
    chain = payload.get("lineage") or [{"id": target, "path": payload.get("path")}]
    ids = [c["id"] for c in chain]
    full = Move(target_id=target, method="full", path=_resolve_dir(payload.get("path"), target, store))
    if not deltas or serving_id is None or serving_id not in ids[1:]:
        return full
    steps = []
    descendants = chain[: ids.index(serving_id)]  # target ... child of serving
    parent = serving_id
    for entry in reversed(descendants):
        try:
            delta = _resolve_dir(entry.get("path"), entry["id"], store) / DELTA_FILE
        except CheckpointError:
            return full
        if not delta.exists():
            return full
        steps.append((entry["id"], delta, parent))
        parent = entry["id"]
    return Move(target_id=target, method="delta", steps=tuple(steps))


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

    def accept(self, payload: dict[str, Any], headers: Iterable[tuple[str, bytes]] | None = None) -> bool:
        """Whether a message is a production change not applied before and newer than the applied one
        (nothing is recorded: a batch whose move fails is accepted again when it is re-read)."""
        if payload.get("type") not in PRODUCTION_CHANGES or not payload.get("checkpoint_id"):
            return False
        if self.deduper.seen(message_identity(payload, headers)):
            return False
        outbox_id = payload.get("outbox_id")
        return not (isinstance(outbox_id, int) and outbox_id <= self.applied_outbox_id)

    def apply(self, payload: dict[str, Any]) -> Move:
        """Move the engine to the message's checkpoint and report it.

        Raises:
            CheckpointError: the target is not available on this node (the caller retries later).
        """
        started = time.perf_counter()
        move = plan_move(
            getattr(self.engine, "checkpoint_id", None),
            payload,
            self.store,
            deltas=getattr(self.engine, "applies_deltas", True),
        )
        if move.method == "delta":
            try:
                for checkpoint_id, delta, parent in move.steps:
                    self.engine.apply_delta(checkpoint_id, delta, parent)
            except CheckpointError as exc:  # a corrupt or mismatched delta: a full load still works
                log.warning("delta chain to %s failed (%s); loading it fully", move.target_id, exc)
                move = Move(
                    target_id=move.target_id,
                    method="full",
                    path=_resolve_dir(payload.get("path"), move.target_id, self.store),
                )
        if move.method == "full":
            self.engine.load_checkpoint(move.target_id, move.path)
        if isinstance(payload.get("outbox_id"), int):
            self.applied_outbox_id = max(self.applied_outbox_id, payload["outbox_id"])
        self.deduper.add(message_identity(payload))
        self.moves.append(move)
        how = {
            "delta": f"by {len(move.steps)} delta(s)",
            "noop": "already served",
            "full": "by a full reload"
            + ("" if getattr(self.engine, "applies_deltas", True) else " (the engine cannot apply deltas)"),
        }[move.method]
        log.info("serving %s %s, after %s", move.target_id, how, payload.get("type"))
        _moves.add(1, {"method": move.method})
        SERVING_RELOAD_DURATION.record(time.perf_counter() - started, {"method": move.method})
        self.report(last_event=payload, method=move.method)
        return move

    def handle_batch(
        self, messages: Sequence[tuple[dict[str, Any], Sequence[tuple[str, bytes]] | None]]
    ) -> Move | None:
        """Apply only the newest accepted production change of a batch (see module docstring), then
        the newest canary change when a canary follower is attached. Returns the production move."""
        accepted = [(p, h) for p, h in messages if self.accept(p, h)]
        move = None
        if accepted:
            newest, headers = max(accepted, key=lambda m: m[0].get("outbox_id") or 0)
            # a child of the promotion (or rollback) span whose context the lifecycle message carries
            with tracer("flywheel.serving").start_as_current_span(
                "serving.reload",
                context=extract_context(headers),
                attributes={"flywheel.checkpoint_id": str(newest["checkpoint_id"]), "flywheel.event": newest["type"]},
            ) as span:
                move = self.apply(newest)
                span.set_attribute("flywheel.method", move.method)
            for p, h in accepted:  # superseded changes of the batch count as handled too
                self.deduper.add(message_identity(p, h))
            self.report(last_event=newest, method=move.method)
        if self.canary is not None:
            changes = [
                (p, h)
                for p, h in messages
                if p.get("type") in CANARY_CHANGES and not self.deduper.seen(message_identity(p, h))
            ]
            if changes:
                self.canary.handle([p for p, _ in changes])
                for p, h in changes:
                    self.deduper.add(message_identity(p, h))
                self.report()
        return move

    def report(self, *, last_event: dict[str, Any] | None = None, method: str | None = None) -> None:
        """Write ``serving.json``: what serves, how it got there, and the resume state."""
        previous = read_serving_state(self.home) or {}
        write_serving_state(
            {
                "checkpoint_id": getattr(self.engine, "checkpoint_id", None),
                "method": method or previous.get("method"),
                "event_id": (last_event or {}).get("event_id", previous.get("event_id")),
                "event_type": (last_event or {}).get("type", previous.get("event_type")),
                "applied_outbox_id": self.applied_outbox_id,
                "seen_event_ids": self.deduper.ids(),
                "offsets": self.offsets,
                **(self.canary.state() if self.canary is not None else {}),
            },
            self.home,
        )


class ServingWatcher:
    """Reads the lifecycle topic (all partitions, manual assignment) and feeds a :class:`ProductionFollower`.

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
        supervise: Callable[[], None] | None = None,
        supervise_interval_s: float = 10.0,
    ) -> None:
        kafka = get_settings().kafka
        self.bootstrap = bootstrap or kafka.bootstrap
        if not self.bootstrap:
            raise InfrastructureError("no broker configured: set FLYWHEEL_KAFKA_BOOTSTRAP or run `flywheel stack up`")
        self.topic = topic or kafka.lifecycle_topic
        self.follower = ProductionFollower(engine, store=store, home=home, canary=canary)
        self._consumer = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
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

    def _connect(self):
        consumer = KafkaConsumer(
            bootstrap_servers=self.bootstrap,
            enable_auto_commit=False,
            group_id=None,
            auto_offset_reset="earliest",
            client_id="flywheel-serving-watcher",
            **kafka_security(),
        )
        partitions = consumer.partitions_for_topic(self.topic) or {0}
        tps = [TopicPartition(self.topic, p) for p in sorted(partitions)]
        consumer.assign(tps)
        for tp in tps:
            saved = self.follower.offsets.get(str(tp.partition))
            if saved is not None:
                consumer.seek(tp, int(saved))
            else:
                consumer.seek_to_beginning(tp)
        return consumer

    def poll_once(self, timeout_ms: int = 1000) -> Move | None:
        """Poll one batch, apply its newest production change, save positions. Returns the move made.

        Raises:
            CheckpointError: the target is not available here; positions are not advanced, so the
                batch is read again on the next poll.
            Exception: the broker or the database failed (``kafka.errors.KafkaError``,
                ``sqlalchemy.exc.DBAPIError``...); likewise nothing is advanced.
        """
        if self._consumer is None:
            self._consumer = self._connect()
        records = self._consumer.poll(timeout_ms=timeout_ms, max_records=500)
        if not records and self._reread_recreated_logs():
            return None
        batch, positions = [], {}
        for tp, msgs in records.items():
            for m in msgs:
                try:  # one typed parse for every follower (app.lifecycle.messages)
                    payload = parse_lifecycle_message(m.value).model_dump(mode="json")
                except LifecycleMessageError as exc:
                    log.warning("skipping lifecycle message %s:%s: %s", tp.partition, m.offset, exc)
                    payload = None
                if payload is not None:
                    batch.append((payload, m.headers))
                positions[str(tp.partition)] = m.offset + 1
        if not positions:
            return None
        try:
            move = self.follower.handle_batch(batch)
        except Exception:
            for tp in self._consumer.assignment():  # re-read this batch next time
                saved = self.follower.offsets.get(str(tp.partition))
                self._consumer.seek(tp, int(saved)) if saved is not None else self._consumer.seek_to_beginning(tp)
            raise
        self.follower.offsets.update(positions)
        self.follower.report()
        return move

    def _reread_recreated_logs(self) -> bool:
        """Read again from its start every assigned partition whose log ends below the position this
        watcher reads from (the broker lost the log: the local stack's broker keeps it in memory and
        starts empty after a restart; a topic deleted and re-created). Without it a production change
        published there would wait until the new log grew past the old position, i.e. be skipped.
        Reading the new log from its start re-applies nothing (messages are deduplicated on their
        ``event_id`` and their ``outbox_id``). Returns whether any partition was.

        The log's end is the high-water mark of the last fetch (``KafkaConsumer.highwater``). The
        consumer is closed and made again (its next poll connects): kafka-python's fetches of a
        re-created topic by the client that knew the old one returned nothing (tansu 0.5, measured).
        """
        stale = []
        for tp in self._consumer.assignment():
            end, position = self._consumer.highwater(tp), self._consumer.position(tp)
            if end is not None and position > end:
                log.warning(
                    "lifecycle partition %s:%d ends at %d, below the position %d read to: the log was "
                    "re-created (a restarted broker); reading it from its start",
                    tp.topic, tp.partition, end, position,
                )  # fmt: skip
                stale.append(tp)
        if not stale:
            return False
        for tp in stale:
            self.follower.offsets.pop(str(tp.partition), None)
        self._consumer.close()
        self._consumer = None
        return True

    def caught_up(self) -> bool:
        """Whether every assigned partition has been read to its current end offset."""
        if self._consumer is None:
            self._consumer = self._connect()
        ends = self._consumer.end_offsets(list(self._consumer.assignment()))
        return all(self._consumer.position(tp) >= end for tp, end in ends.items())

    def run(self, *, idle_exit: bool = False, poll_ms: int = 1000) -> None:
        """Poll until :meth:`stop` (or, with ``idle_exit``, until the topic is read to its end). A
        checkpoint not available here yet, or a broker or database fault (a restart, a network
        partition), is retried with backoff (1 s doubling, at most 30 s): serving keeps the model it
        has and moves once the fault clears, never skipping a production change.

        Raises:
            Exception: a fault that is not transient (``app.core.retry.is_transient``).
        """
        backoff = Backoff(30.0, initial=1.0)
        while not self._stop.is_set():
            self.supervise()
            try:
                self.poll_once(timeout_ms=poll_ms)
                backoff.reset()
                if idle_exit and self.caught_up():
                    return
            except Exception as exc:
                if not (isinstance(exc, CheckpointError) or is_transient(exc)):
                    raise
                wait_s = backoff.next()
                if isinstance(exc, CheckpointError):  # the directory may not be synced yet
                    log.warning("cannot move serving yet (%s); retrying in %.0fs", exc, wait_s)
                else:
                    log.warning(
                        "following production failed (%s: %s); retrying in %.0fs",
                        type(exc).__name__,
                        str(exc).splitlines()[0] if str(exc) else "",
                        wait_s,
                    )
                self._stop.wait(wait_s)

    def start(self) -> threading.Thread:
        """Run in a daemon thread (embed in a serving process that owns the engine)."""
        self._thread = threading.Thread(target=self.run, name="serving-watcher", daemon=True)
        self._thread.start()
        return self._thread

    def stop(self, timeout_s: float = 10.0) -> None:
        """Stop polling and close the consumer."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._consumer is not None:
            self._consumer.close()
            self._consumer = None


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
    supervise = None
    if VLLMServer.load(flywheel_home(), "production") is not None:
        supervise = lambda: ensure_server("production")  # noqa: E731
    watcher = ServingWatcher(engine, canary=CanaryFollower(EngineRouter(engine)), supervise=supervise)
    watcher.follower.report()
    signal.signal(signal.SIGTERM, lambda *_: watcher._stop.set())
    try:
        watcher.run(idle_exit=once)
    finally:
        watcher.stop()

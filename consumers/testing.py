"""Realistic synthetic agent sessions, for tests and ``bench/ingest.py`` (not used in production).

A session is what the agent harness emits: ``session.started``, ``agent.requested``, segments of
``model.responded`` turns (real-sized token arrays with behaviour log-probs and tool calls) each
followed by ``tool.executed``, ``context.summarized`` between segments, edits proposed and
accepted/rejected, ``session.ended`` naming the late signals to expect, then those late signals
(``edit.persistence_measured``, ``followup.sent``). Generation is deterministic for a seed.
"""

from __future__ import annotations

import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any, Literal, TypeVar

import numpy as np
import psycopg
from kafka import KafkaProducer

from producers.events import encode_event
from producers.events.types import (
    AgentRequested,
    AgentRequestedEvent,
    ContextSummarized,
    ContextSummarizedEvent,
    EditAccepted,
    EditAcceptedEvent,
    EditPersistenceMeasured,
    EditPersistenceMeasuredEvent,
    EditProposed,
    EditProposedEvent,
    EditRejected,
    EditRejectedEvent,
    EventBase,
    FollowupSent,
    FollowupSentEvent,
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

T = TypeVar("T")

VOCAB = 49_152


def _uuid7_like(rng: np.random.Generator, ms: int) -> uuid.UUID:
    """A UUIDv7 from a millisecond timestamp and the seeded RNG (deterministic, time-ordered)."""
    rand = int.from_bytes(rng.bytes(10), "big")
    value = (
        (ms & ((1 << 48) - 1)) << 80 | 0x7 << 76 | (rand >> 68 & 0xFFF) << 64 | 0b10 << 62 | (rand & ((1 << 62) - 1))
    )
    return uuid.UUID(int=value)


def generate_session(
    rng: np.random.Generator,
    *,
    session_id: str,
    user_id: str,
    start: datetime,
    task_id: str | None = None,
    checkpoint_id: str = "base",
    privacy_mode: bool = False,
    max_segments: int = 3,
    max_turns: int = 4,
    prompt_tokens: tuple[int, int] = (150, 400),
    completion_tokens: tuple[int, int] = (20, 160),
    withhold_signal: bool = False,
    p_tool_ok: float = 0.7,
    p_accept: float = 0.75,
) -> list[EventBase]:
    """One session's events in emission order.

    Args:
        withhold_signal: list an expected signal in ``session.ended`` that never comes (the
            trajectory then stays provisional until its window closes).
        p_tool_ok: probability that a tool call succeeds (a test run passes).
        p_accept: probability that the developer accepts an edit (else rejects it). Neither
            probability changes the draws, so sessions from one seed have the same turns and tokens.
    """
    clock = [start]
    env = dict(session_id=session_id, user_id=user_id, privacy_mode=privacy_mode)

    def at(seconds: float) -> dict[str, Any]:
        clock[0] = clock[0] + timedelta(seconds=seconds)
        ms = int(clock[0].timestamp() * 1000)
        return dict(env, occurred_at=clock[0], event_id=_uuid7_like(rng, ms))

    task_id = task_id or f"task-{int(rng.integers(0, 500))}"
    events: list[EventBase] = [
        SessionStartedEvent(
            **at(0), payload=SessionStarted(task_id=task_id, task_source="dataframebench", checkpoint_id=checkpoint_id)
        ),
        AgentRequestedEvent(**at(0.5), payload=AgentRequested(request_id="r0", text="fix the failing test in df.py")),
    ]
    n_segments = int(rng.integers(1, max_segments + 1))
    call = 0
    for seg in range(n_segments):
        if seg:
            events.append(
                ContextSummarizedEvent(
                    **at(0.2),
                    payload=ContextSummarized(
                        new_segment_index=seg, summary="summary of the work so far", summarized_tokens=2000
                    ),
                )
            )
        for turn in range(int(rng.integers(1, max_turns + 1))):
            n_prompt = int(rng.integers(*prompt_tokens)) if turn == 0 else int(rng.integers(10, 120))
            n_comp = int(rng.integers(*completion_tokens))
            call += 1
            name = "run" if rng.random() < 0.4 else "edit_file"
            tool = ToolCall(
                call_id=f"c{call}",
                name=name,
                arguments={"cmd": "pytest -q"} if name == "run" else {"path": "df.py", "text": "x = 1"},
            )
            events.append(
                ModelRespondedEvent(
                    **at(float(rng.uniform(0.5, 6.0))),
                    payload=ModelResponded(
                        request_id="r0",
                        segment_index=seg,
                        turn_index=turn,
                        checkpoint_id=checkpoint_id,
                        prompt_token_ids=rng.integers(0, VOCAB, n_prompt).tolist(),
                        completion_token_ids=rng.integers(0, VOCAB, n_comp).tolist(),
                        completion_logprobs=(-rng.exponential(0.8, n_comp)).astype(np.float32).tolist(),
                        latency_s=round(float(rng.uniform(0.3, 8.0)), 3),
                        tool_calls=(tool,),
                        vocab_size=VOCAB,
                    ),
                )
            )
            ok = bool(rng.random() < p_tool_ok)
            events.append(
                ToolExecutedEvent(
                    **at(0.4),
                    payload=ToolExecuted(
                        call_id=tool.call_id,
                        name=name,
                        ok=ok,
                        exit_code=0 if ok else 1,
                        output="1 passed" if ok else "AssertionError: expected 3",
                        duration_s=0.4,
                        ran_tests=name == "run",
                        command="pytest -q" if name == "run" else None,
                    ),
                )
            )
    expected: list[str] = []
    late: list[EventBase] = []
    for e in range(int(rng.integers(0, 3))):
        edit_id = f"e{e}"
        events.append(
            EditProposedEvent(
                **at(0.3),
                payload=EditProposed(
                    edit_id=edit_id,
                    path="df.py",
                    lines_added=int(rng.integers(1, 40)),
                    lines_removed=int(rng.integers(0, 20)),
                ),
            )
        )
        if rng.random() < p_accept:
            events.append(EditAcceptedEvent(**at(2.0), payload=EditAccepted(edit_id=edit_id)))
            expected.append("edit.persistence_measured")
            late.append(
                EditPersistenceMeasuredEvent(
                    **at(600),
                    payload=EditPersistenceMeasured(
                        edit_id=edit_id, fraction_persisted=round(float(rng.uniform(0, 1)), 3), delay_s=600
                    ),
                )
            )
        else:
            events.append(EditRejectedEvent(**at(2.0), payload=EditRejected(edit_id=edit_id)))
    if rng.random() < 0.3:
        expected.append("followup.sent")
        late.append(
            FollowupSentEvent(
                **at(30), payload=FollowupSent(text="that broke the other test", dissatisfied=bool(rng.random() < 0.6))
            )
        )
    if withhold_signal:
        expected.append("edit.persistence_measured")
    end = SessionEndedEvent(
        **at(1.0), payload=SessionEnded(reason="finished", turns=call, ran_tests=True, expected_signals=tuple(expected))
    )
    # late signals were timestamped after their cause; they are emitted after the end
    late.sort(key=lambda ev: ev.occurred_at)
    return events + [end] + late


def generate_stream(
    n_events: int,
    *,
    seed: int = 0,
    users: int = 40,
    concurrency: int = 24,
    start: datetime | None = None,
    privacy_fraction: float = 0.0,
    withhold_fraction: float = 0.0,
    **session_kw: Any,
) -> list[EventBase]:
    """About ``n_events`` events of many sessions, interleaved as ``concurrency`` sessions would be
    live at once (each session's own order is kept). Whole sessions only: may exceed ``n_events``
    by one session. ``start`` (default: early enough that the whole stream lies in the past, so an
    ingest consumer's time window admits it) is the first session's start; each next one starts 1 s
    later."""
    rng = np.random.default_rng(seed)
    start = start or datetime.now(UTC).replace(microsecond=0) - timedelta(seconds=n_events + 7200)
    sessions: list[list[EventBase]] = []
    total = 0
    while total < n_events:
        i = len(sessions)
        s = generate_session(
            rng,
            session_id=f"s-{seed}-{i:06d}",
            user_id=f"u-{int(rng.integers(0, users)):03d}",
            start=start + timedelta(seconds=i),
            privacy_mode=bool(rng.random() < privacy_fraction),
            withhold_signal=bool(rng.random() < withhold_fraction),
            **session_kw,
        )
        sessions.append(s)
        total += len(s)
    out: list[EventBase] = []
    live: list[list[EventBase]] = []
    queue = [list(reversed(s)) for s in sessions]
    while queue or live:
        while queue and len(live) < concurrency:
            live.append(queue.pop(0))
        j = int(rng.integers(0, len(live)))
        out.append(live[j].pop())
        if not live[j]:
            live.pop(j)
    return out


def traceparent_for(session_id: str) -> bytes:
    """A W3C ``traceparent`` per session (as if the backend traced each session)."""
    h = uuid.uuid5(uuid.NAMESPACE_URL, session_id).hex
    return f"00-{h}-{h[:16]}-01".encode()


def kafka_record(event: EventBase) -> tuple[bytes, bytes, list[tuple[str, bytes]]]:
    """(key, value, headers) exactly as the producer SDK sends an event."""
    return (
        event.session_id.encode(),
        encode_event(event),
        [("traceparent", traceparent_for(event.session_id)), ("event-type", event.type.encode())],
    )


def produce(
    bootstrap: str,
    topic: str,
    records: Iterable[tuple[bytes | None, bytes | None, Sequence[tuple[str, bytes]]]],
    *,
    linger_ms: int = 20,
    compression: Literal["none", "gzip", "zstd"] = "none",
) -> int:
    """Send (key, value, headers) records with a kafka-python producer and wait for every ack.

    ``compression``: the record batches' codec, ``none`` | ``gzip`` | ``zstd`` (the producer SDK
    sends ``zstd``: ``producers.client.default_compression``).

    Returns:
        records sent.
    """
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=linger_ms,
        batch_size=256 * 1024,
        max_request_size=8 * 1024 * 1024,
        compression_type=None if compression == "none" else compression,
    )
    n = 0
    try:
        futures = []
        for key, value, headers in records:
            futures.append(producer.send(topic, key=key, value=value, headers=list(headers)))
            n += 1
        producer.flush(timeout=120)
        for f in futures:
            f.get(timeout=60)
    finally:
        producer.close(timeout=10)
    return n


# ---- running consumers in tests and benches ----------------------------------------------------


def consumer_process(
    env: dict[str, str], *, group: str | None = None, idle_exit_s: float | None = None, log_path: Path | None = None
) -> subprocess.Popen[bytes]:
    """Start ``flywheel consume`` as a subprocess (its own process group) with ``env``."""
    cmd = [sys.executable, "-c", "from ops.cli import main; main()", "consume"]
    if group:
        cmd += ["--group", group]
    if idle_exit_s is not None:
        cmd += ["--idle-exit", str(idle_exit_s)]
    out = open(log_path, "ab") if log_path else subprocess.DEVNULL
    return subprocess.Popen(
        cmd, env=env, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True
    )


def wait_for(predicate: Callable[[], T], timeout_s: float, interval_s: float = 0.25, what: str = "condition") -> T:
    """Poll ``predicate()`` until truthy; return its value.

    Raises:
        TimeoutError: not true within ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"{what} not reached in {timeout_s}s (last: {value!r})")
        time.sleep(interval_s)


def scalar(url: str, sql: str, params: tuple[Any, ...] = ()) -> Any:
    """First column of the first row of ``sql`` on ``url`` (libpq URL), in autocommit."""
    with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), autocommit=True) as conn:
        row = conn.execute(sql, params).fetchone()
        return row[0] if row else None

"""Throughput of ``EventProducer`` next to a bare kafka-python ``KafkaProducer`` in the same run.

Both send the same records to the same broker: key = session_id, the same value bytes and
``event-type`` header, ``acks=all``, the same compression, ``linger_ms`` and batch size. The baseline gets the
values pre-encoded; ``EventProducer`` is timed from typed event objects (it validates, encodes, adds
trace headers, buffers and waits for acknowledgements), so the ratio is the SDK's whole overhead
net of its one optimisation: it memoizes each session key's partition (the same partition kafka's
default murmur2 partitioner picks, which the baseline computes per record).
Each side is timed from the first send to the last acknowledgement (``flush``); rounds alternate
and the median round counts, which damps noise from other processes on a shared machine.

Starts its own ``tansu`` broker unless ``FLYWHEEL_KAFKA_BOOTSTRAP`` is set. Ends with one JSON line.

Flags: ``--quick`` (fewer events and rounds), ``--events N`` (per round), ``--rounds N`` (per side;
the median counts), ``--compression zstd|gzip|none`` (default zstd if available), ``--linger-ms N`` (5).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
import uuid
from pathlib import Path

from kafka import KafkaProducer

from app.core.pids import stop_pid
from ops.broker import create_topics, start_broker
from producers.client import DEFAULT_BATCH_BYTES, default_compression
from producers.events import encode_event
from producers.events.types import (
    AgentRequested,
    AgentRequestedEvent,
    EditAccepted,
    EditAcceptedEvent,
    EditProposed,
    EditProposedEvent,
    ModelResponded,
    ModelRespondedEvent,
    ToolExecuted,
    ToolExecutedEvent,
)
from producers.producer import EventProducer

TARGET = 0.7


def make_events(n: int, tokens: int = 128) -> list:
    """A realistic mix per agent turn: request, model response (``tokens`` completion tokens),
    tool run, edit proposed/accepted; sessions of 10 turns."""
    events = []
    i = 0
    while len(events) < n:
        sid, turn = f"session-{i // 10}", i % 10
        base = dict(session_id=sid, user_id=f"user-{i % 97}")
        events += [
            AgentRequestedEvent(**base, payload=AgentRequested(request_id=f"r{i}", text="make the test pass " * 4)),
            ModelRespondedEvent(
                **base,
                payload=ModelResponded(
                    request_id=f"r{i}",
                    segment_index=0,
                    turn_index=turn,
                    checkpoint_id="base",
                    prompt_token_ids=list(range(32)),
                    completion_token_ids=list(range(tokens)),
                    completion_logprobs=[-0.25] * tokens,
                    latency_s=0.5,
                ),
            ),
            ToolExecutedEvent(
                **base,
                payload=ToolExecuted(
                    call_id=f"c{i}", name="run", ok=True, exit_code=0, output="1 passed in 0.01s", ran_tests=True
                ),
            ),
            EditProposedEvent(
                **base,
                payload=EditProposed(
                    edit_id=f"e{i}", path="src/app.py", lines_added=3, diff="+x = 1\n+y = 2\n+z = 3\n"
                ),
            ),
            EditAcceptedEvent(**base, payload=EditAccepted(edit_id=f"e{i}")),
        ]
        i += 1
    return events[:n]


def run_ours(bootstrap: str, topic: str, events: list, compression: str, linger_ms: int) -> tuple[float, float]:
    """``(events/s, CPU µs per event over all threads)`` of ``EventProducer`` from typed events."""
    with tempfile.TemporaryDirectory() as spool:
        producer = EventProducer(
            bootstrap,
            topic,
            spool_dir=Path(spool),
            compression=compression,
            linger_ms=linger_ms,
            buffer_size=len(events) + 1,
        )
        try:
            producer.emit(events[0])
            producer.flush()  # connected and metadata known before timing, as for the baseline
            t0, c0 = time.perf_counter(), time.process_time()
            for ev in events:
                producer.emit(ev)
            producer.flush()
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
            m = producer.metrics
            if m["sent"] != len(events) + 1 or m["spooled"]:
                raise SystemExit(f"EventProducer did not deliver everything: {m}")
        finally:
            producer.close()
    return len(events) / elapsed, cpu / len(events) * 1e6


def run_bare(bootstrap: str, topic: str, events: list, compression: str, linger_ms: int) -> tuple[float, float]:
    """``(events/s, CPU µs per event)`` of a bare ``KafkaProducer`` sending pre-encoded records."""
    records = [(ev.session_id.encode(), encode_event(ev), [("event-type", ev.type.encode())]) for ev in events]
    producer = KafkaProducer(
        bootstrap_servers=bootstrap,
        acks="all",
        linger_ms=linger_ms,
        batch_size=DEFAULT_BATCH_BYTES,
        compression_type=None if compression == "none" else compression,
    )
    try:
        producer.send(topic, value=records[0][1], key=records[0][0], headers=records[0][2]).get(30)
        t0, c0 = time.perf_counter(), time.process_time()
        futures = [producer.send(topic, value=v, key=k, headers=h) for k, v, h in records]
        producer.flush()
        elapsed, cpu = time.perf_counter() - t0, time.process_time() - c0
        if not all(f.succeeded() for f in futures):
            raise SystemExit("bare producer failed to deliver")
    finally:
        producer.close()
    return len(events) / elapsed, cpu / len(events) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer events and rounds (about 10 s)")
    parser.add_argument("--events", type=int, default=None, help="events per round")
    parser.add_argument("--rounds", type=int, default=None, help="rounds per side (median counts)")
    parser.add_argument("--compression", default=None, help="zstd | gzip | none (default: zstd if available)")
    parser.add_argument("--linger-ms", type=int, default=5)
    args = parser.parse_args(argv)
    n = args.events or (5_000 if args.quick else 20_000)
    rounds = args.rounds or (3 if args.quick else 7)

    compression = args.compression or default_compression()
    bootstrap, broker = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP"), None
    with tempfile.TemporaryDirectory() as tmp:
        if not bootstrap:
            broker = start_broker(Path(tmp) / "logs")
            bootstrap = broker.bootstrap
        try:
            events = make_events(n)
            ours, bare = [], []
            for r in range(rounds):
                topic = f"bench.produce.{uuid.uuid4().hex[:8]}"
                create_topics(bootstrap, {topic: 4})
                # Alternate who goes first so neither side always meets a warmer broker.
                sides = [("bare", run_bare), ("ours", run_ours)]
                for name, fn in sides if r % 2 == 0 else sides[::-1]:
                    rate, cpu_us = fn(bootstrap, topic, events, compression, args.linger_ms)
                    (ours if name == "ours" else bare).append(rate)
                    print(
                        f"round {r}: {name:4s} {rate:10.0f} events/s  ({cpu_us:5.1f} CPU-us/event, all threads)",
                        file=sys.stderr,
                    )
                print(f"round {r}: ratio {ours[-1] / bare[-1]:.3f}", file=sys.stderr)
        finally:
            if broker is not None:
                stop_pid(broker.pid)
    o, b = statistics.median(ours), statistics.median(bare)
    ratio = o / b
    print(
        json.dumps(
            {
                "bench": "produce",
                "ours": round(o, 1),
                "baseline": round(b, 1),
                "unit": "events/s",
                "ratio": round(ratio, 3),
                "target": TARGET,
                "pass": ratio >= TARGET,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

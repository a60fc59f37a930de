"""End-to-end ingest throughput: Kafka -> Postgres (event_log + trajectory projections + offsets, one
transaction per batch, exactly-once) next to a bare kafka-python consume loop over the same messages.

Set-up: a tansu broker started here (memory storage; the topic has the interactions topic's
partitions, 8 by default), scratch Postgres databases (created on the server of
``FLYWHEEL_DATABASE_URL`` if set, else on the local server 127.0.0.1:5432, else on an embedded server
started here), migrated, dropped at the end. ``consumers.testing.generate_stream`` produces
realistic sessions (100k events; 20k with ``--quick``): ``model.responded`` turns with real-sized
token arrays, tool calls, edits, context summaries, ends and late signals; a share of sessions
withholds an expected signal so their trajectories finalize by the window. They are produced
compressed as the producer SDK sends them (zstd record batches; ``--compression`` to change), so
both sides decompress what production's consumers would.

Measured in one run, each from its first polled record to its last (the group join is excluded
from both; but a member whose follower ``SyncGroup`` reaches tansu before the leader's is answered
later than the others, and that delay counts against ours: its partitions start late. The single
bare consumer leads its own group):

- *warm-up*: a bare pass over the topic (not counted: tansu serves its first read of fresh data
  slower);
- *baseline*: a bare ``KafkaConsumer`` poll loop (same group settings, same ``max_poll_records``)
  that touches every record's value and does nothing else; the median of ``--passes`` (3) passes;
- *ours*: the ingest consumer group as deployed, 4 ``flywheel consume`` processes (two partitions
  each; ``--consumers 1`` runs one in this process), timed from the first record any of them
  polled (each logs when) to the batch that stores the last event (progress read from the group's
  offsets in Postgres, which commit with the events), then checks every event is in ``event_log``
  exactly once; the median of as many passes, each a new consumer group into a new database
  (``ours_passes`` lists them all). The two sides' passes alternate (bare, ours, bare, ...), so a
  machine whose speed drifts over minutes weighs on both alike; ``pair_ratios`` gives each pair's
  ratio. The bare loop is a single process: a Python consumer that validates, stores and
  projects every event is CPU-bound, and scaling out over partitions is how it is meant to run.
  More processes than cores lets one process decode while another waits on its Postgres round
  trips;
- *finalize*: after the 1 s signal window has closed, the time ``flywheel finalize`` takes to
  finalize and label every remaining provisional trajectory.

Ends with one JSON line; ratio = ours / baseline events/s, target >= 0.5. Next to it,
``cpu_us_per_event`` (consumers + Postgres + broker, ours), ``baseline_cpu_us_per_event`` (the bare
loop's process + broker) and ``ratio_cpu_bound``: the ratio ours would reach with every core busy at
the CPU per event it measured, i.e. ``cores / (cpu_us_per_event * baseline)``; the gap between ratio
and bound is start-up and tail, the gap between bound and target is CPU.

Flags: ``--quick`` (20k events), ``--events N``, ``--consumers N`` (processes in the group, default
4), ``--partitions N``, ``--insert-method copy|copy_upsert|unnest``, ``--batch N`` (records per poll
and transaction), ``--privacy-fraction F`` (share of sessions in privacy mode), ``--passes N``,
``--compression none|gzip|zstd``, ``--layouts partitioned,unpartitioned`` (ours on each ``event_log``
layout in the same run, passes alternating; ``layouts`` in the JSON gives each one's median events/s
and WAL bytes per event, read with ``pg_current_wal_lsn`` around each pass: on a server no one else
writes to, e.g. the embedded one). Measured results: ``docs/benchmarks.md``.

Size: over 400 lines because the baseline and our consumer (in process, and as a group of processes
sampled for CPU) are set up and measured side by side in one run, which is what a bench is.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import sys
import tempfile
import time
import uuid
from pathlib import Path

import numpy as np
import psutil
import psycopg
from kafka import KafkaConsumer

from app.core.db import reset_engines
from app.core.migrate import upgrade
from app.core.pids import stop_pid
from app.core.settings import get_settings
from consumers.finalize import finalize_due
from consumers.ingest import IngestConsumer, projector_from_settings
from consumers.settings import get_consumer_settings
from consumers.testing import consumer_process, generate_stream, kafka_record, produce, scalar
from ops.broker import create_topics, start_broker
from ops.postgres import start_postgres, stop_postgres
from producers.client import default_compression

TARGET = 0.5
GROUP_SETTINGS = dict(max_poll_interval_ms=5000, session_timeout_ms=6000, heartbeat_interval_ms=1000)


def scratch_server(tmp: Path):
    """(libpq admin url, stop) of the Postgres server of ``FLYWHEEL_DATABASE_URL`` if set, else the
    local server 127.0.0.1:5432, else an embedded server started here (``stop`` stops only that)."""
    admin = os.environ.get("FLYWHEEL_TEST_ADMIN_URL", "postgresql://postgres@127.0.0.1:5432/postgres")
    if os.environ.get("FLYWHEEL_DATABASE_URL"):
        admin = (
            os.environ["FLYWHEEL_DATABASE_URL"].replace("postgresql+psycopg://", "postgresql://").rsplit("/", 1)[0]
            + "/postgres"
        )
    try:
        psycopg.connect(admin, connect_timeout=2).close()
    except psycopg.Error:
        server = start_postgres(tmp / "pgdata", database="postgres")
        return f"postgresql://postgres@127.0.0.1:{server.port}/postgres", lambda: stop_postgres(tmp / "pgdata")
    return admin, lambda: None


LAYOUTS = {"partitioned": "head", "unpartitioned": "0022"}
"""``--layouts``: the revision each ``event_log`` layout is migrated to (0023 partitions it)."""


def scratch_database(admin: str, revision: str = "head"):
    """(libpq url, drop) of a fresh database on the server of ``admin``, migrated to ``revision``."""
    name = f"flywheel_bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(admin, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = admin.rsplit("/", 1)[0] + f"/{name}"
    upgrade(url=url, revision=revision)

    def drop() -> None:
        reset_engines()
        with psycopg.connect(admin, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')

    return url, drop


def bare_consume(bootstrap: str, topic: str, n: int, max_records: int) -> tuple[float, float]:
    """(events/s, CPU us per event) of a bare kafka-python loop over ``n`` records, both from the
    first record to the last; the CPU is this process's (the loop and its client's threads) plus the
    broker's."""
    c = KafkaConsumer(
        topic,
        bootstrap_servers=bootstrap,
        group_id=f"bare-{uuid.uuid4().hex[:6]}",
        auto_offset_reset="earliest",
        enable_auto_commit=False,
        max_poll_records=max_records,
        fetch_max_bytes=52_428_800,
        **GROUP_SETTINGS,
    )
    seen, nbytes, start, cpu0 = 0, 0, None, None
    while seen < n:
        for recs in c.poll(timeout_ms=100, max_records=max_records).values():
            if start is None:
                start, cpu0, first = time.monotonic(), _bare_cpu_seconds(), len(recs)
            for r in recs:
                nbytes += len(r.value or b"")
            seen += len(recs)
    elapsed, cpu = time.monotonic() - start, _bare_cpu_seconds() - cpu0
    c.close(autocommit=False)
    return seen / elapsed, cpu / max(1, seen - first) * 1e6


def _bare_cpu_seconds() -> float:
    """user+system CPU seconds of this process and the tansu broker."""
    return time.process_time() + _cpu_seconds(())["broker"]


def ours_in_process(n: int) -> tuple[float, dict]:
    stats = IngestConsumer(client_id="bench").run(stop_after=n)
    elapsed = stats.last_batch_at - stats.first_record_at
    return stats.messages / elapsed, {"batches": stats.batches, "dead_letters": sum(stats.dead_letters.values())}


FIRST_RECORD = re.compile(rb"first record polled at (\d+\.\d+)")


def ours_processes(n: int, k: int, url: str, log: Path, group: str, topic: str) -> tuple[float, dict]:
    """events/s of ``k`` ``flywheel consume`` processes, from the first record any of them polled
    (the time each logs) to the batch that stores the last event, like the bare loop's first record
    to last; and the CPU seconds each side used per event over the same span. The CPU counters are
    sampled every 50 ms until the first batch lands, and read at the first record polled by linear
    interpolation between the samples around it: reading them at the first committed batch instead
    missed the batches members had already fetched and decoded by then (the pipeline holds up to
    two per member), which at 20k events halved the figure.

    Progress is read from the group's stored offsets (committed in the same transaction as the
    events, so they count exactly what is stored) on one connection: a ``count(*)`` over
    ``event_log`` every 100 ms would itself cost a noticeable share of a core.
    """
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": url}
    log_start = log.stat().st_size if log.exists() else 0
    procs = [consumer_process(env, log_path=log) for _ in range(k)]
    samples: list[tuple[float, dict[str, float]]] = []  # (unix s, CPU s by kind) until the first batch lands
    sampling = True
    try:
        with psycopg.connect(url, autocommit=True) as conn:
            while True:
                done = conn.execute(
                    "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offset "
                    "WHERE group_id = %s AND topic = %s",
                    (group, topic),
                ).fetchone()[0]
                if sampling:
                    samples.append((time.time(), _cpu_seconds(procs)))
                    sampling = not done  # the sample taken once a batch has landed is the last
                if done >= n:
                    end = time.time() - 0.025  # half the polling interval: the last batch landed in between
                    break
                time.sleep(0.05)
        cpu_end = _cpu_seconds(procs)
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
    with open(log, "rb") as f:
        f.seek(log_start)
        starts = [float(m.group(1)) for m in FIRST_RECORD.finditer(f.read())]
    elapsed = end - min(starts)
    cpu0 = cpu_at(samples, min(starts))
    cpu = {kind: round(v - cpu0[kind], 2) for kind, v in cpu_end.items()}
    return n / elapsed, {
        "elapsed_s": round(elapsed, 2),
        "cpu_s": cpu,
        "cpu_us_per_event": round(sum(cpu.values()) / n * 1e6, 1),
    }


def cpu_at(samples: list[tuple[float, dict[str, float]]], t: float) -> dict[str, float]:
    """CPU seconds per kind at unix time ``t``, linearly interpolated (``numpy.interp``) between the
    ``samples`` ((unix s, CPU s by kind), in time order) around it; the nearest sample outside their
    span."""
    times = [at for at, _ in samples]
    return {k: float(np.interp(t, times, [cpu[k] for _, cpu in samples])) for k in samples[0][1]}


def _cpu_seconds(procs) -> dict[str, float]:
    """user+system CPU seconds of the consumer processes and of the Postgres and tansu servers."""
    out = {"consumers": 0.0, "postgres": 0.0, "broker": 0.0}
    pids = {p.pid for p in procs}
    for proc in psutil.process_iter(["name", "pid"]):
        try:
            name = proc.info["name"] or ""
            kind = (
                "consumers"
                if proc.info["pid"] in pids
                else "postgres"
                if name.startswith("postgres")
                else "broker"
                if "tansu" in name
                else None
            )
            if kind:
                t = proc.cpu_times()
                out[kind] += t.user + t.system
        except psutil.Error:
            continue
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="20k events instead of 100k")
    ap.add_argument("--events", type=int, default=None)
    ap.add_argument(
        "--consumers", type=int, default=4, help="consumer processes in the group (default 4: two per core here)"
    )
    ap.add_argument(
        "--partitions",
        type=int,
        default=None,
        help="partitions of the bench topic (default: the interactions topic's setting, 8)",
    )
    ap.add_argument("--insert-method", default="copy", choices=["copy", "copy_upsert", "unnest"])
    ap.add_argument("--batch", type=int, default=None, help="records per poll / transaction")
    ap.add_argument(
        "--privacy-fraction",
        type=float,
        default=0.0,
        help="share of sessions in privacy mode (their events are counted, not stored)",
    )
    ap.add_argument("--passes", type=int, default=3, help="timed passes of each side; the medians are compared")
    ap.add_argument(
        "--layouts",
        default="partitioned",
        help="event_log layouts ours runs on, comma-separated (partitioned, unpartitioned: migrated to 0022); "
        "the first is ours, each gets its own passes, alternating order, and its WAL bytes per event",
    )
    ap.add_argument(
        "--compression",
        default=None,
        choices=["none", "gzip", "zstd"],
        help="record batch codec (default: what the producer SDK sends, zstd)",
    )
    args = ap.parse_args()
    n_target = args.events or (20_000 if args.quick else 100_000)
    layouts = args.layouts.split(",")
    if not set(layouts) <= set(LAYOUTS):
        ap.error(f"--layouts: one or more of {', '.join(LAYOUTS)}")

    compression = args.compression or default_compression()

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-ingest-"))
    os.environ["FLYWHEEL_HOME"] = str(tmp)
    os.environ.setdefault("FLYWHEEL_TELEMETRY_EXPORTER", "none")
    os.environ["FLYWHEEL_CONSUMER_INSERT_METHOD"] = args.insert_method
    os.environ["FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S"] = "1"
    os.environ["FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S"] = "3600"  # the finalize phase is timed separately
    os.environ["FLYWHEEL_CONSUMER_FINALIZE_GRACE_S"] = "0"
    if args.batch:
        os.environ["FLYWHEEL_CONSUMER_BATCH_MAX_RECORDS"] = str(args.batch)

    broker = start_broker(tmp / "logs")
    admin, stop_server = scratch_server(tmp)
    drops: list = []
    finished = False
    try:
        topic = "bench.interactions"
        os.environ.update(
            FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
            FLYWHEEL_KAFKA_INTERACTIONS_TOPIC=topic,
            FLYWHEEL_KAFKA_DLQ_TOPIC="bench.dlq",
        )

        get_settings.cache_clear()
        get_consumer_settings.cache_clear()
        partitions = args.partitions or get_settings().kafka.partitions
        create_topics(broker.bootstrap, {topic: partitions, "bench.dlq": 1})

        events = generate_stream(n_target, seed=42, withhold_fraction=0.1, privacy_fraction=args.privacy_fraction)
        n = len(events)
        private = sum(e.privacy_mode for e in events)
        records = [kafka_record(e) for e in events]
        mean_bytes = sum(len(r[1]) for r in records) / n
        del events
        t = time.monotonic()
        produce(broker.bootstrap, topic, records, compression=compression)
        produce_s = time.monotonic() - t
        del records
        max_records = get_consumer_settings().batch_max_records

        bare_consume(broker.bootstrap, topic, n, max_records)  # warm-up, not counted
        # The sides alternate, a bare pass then one of ours, so that a machine whose speed drifts over
        # minutes (a shared host) weighs on both alike; each side reports its median pass. Each pass of
        # ours is a new consumer group into a new database (one pass in a few starts a member ~1 s
        # late, see the module docstring).
        bare, by_layout = [], {layout: [] for layout in layouts}
        for i in range(args.passes):
            bare.append(bare_consume(broker.bootstrap, topic, n, max_records))
            for layout in layouts if i % 2 == 0 else layouts[::-1]:
                url, drop = scratch_database(admin, LAYOUTS[layout])
                drops.append(drop)
                kind = scalar(url, "SELECT relkind::text FROM pg_class WHERE relname = 'event_log'")
                assert kind == ("p" if layout == "partitioned" else "r"), f"{layout}: event_log has relkind {kind}"
                group = f"bench-ingest-{uuid.uuid4().hex[:6]}"
                os.environ.update(FLYWHEEL_DATABASE_URL=url, FLYWHEEL_KAFKA_CONSUMER_GROUP=group)
                get_settings.cache_clear()
                reset_engines()
                wal0 = scalar(url, "SELECT pg_current_wal_lsn()::text")
                if args.consumers == 1:
                    rate, extra = ours_in_process(n)
                else:
                    rate, extra = ours_processes(n, args.consumers, url, tmp / "consumers.log", group, topic)
                # the server's WAL over the pass: other databases' writes count too (a shared server)
                wal = scalar(url, "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), %s::pg_lsn)", (wal0,))
                stored = scalar(url, "SELECT count(*) FROM event_log")
                distinct = scalar(url, "SELECT count(DISTINCT event_id) FROM event_log")
                tombstoned = scalar(url, "SELECT coalesce(sum(events_dropped), 0) FROM privacy_tombstone")
                assert stored == distinct == n - private and tombstoned == private, (
                    f"exactly-once violated ({layout}): {stored} rows, {distinct} distinct, {tombstoned} "
                    f"tombstoned, {n} sent ({private} in privacy mode)"
                )
                extra["wal_bytes_per_event"] = round(float(wal) / max(stored, 1))
                by_layout[layout].append((rate, len(drops) - 1, url, extra))
        passes = by_layout[layouts[0]]
        layout_report = {
            layout: {
                "ours": round(sorted(p[0] for p in ps)[len(ps) // 2], 1),
                "passes": [round(p[0]) for p in ps],
                "wal_bytes_per_event": sorted(p[3]["wal_bytes_per_event"] for p in ps)[len(ps) // 2],
            }
            for layout, ps in by_layout.items()
        }
        if len(layouts) > 1:
            layout_report["ratio_to_" + layouts[1]] = round(
                layout_report[layouts[0]]["ours"] / layout_report[layouts[1]]["ours"], 3
            )
        pair_ratios = [round(p[0] / b[0], 3) for p, b in zip(passes, bare)]
        baseline, bare_cpu_us = sorted(bare)[len(bare) // 2]  # the median pass: a shared machine is noisy
        ours, median_i, url, extra = sorted(passes, key=lambda p: p[0])[len(passes) // 2]
        for i, d in enumerate(drops):
            if i != median_i:
                d()
        drops = [drops[median_i]]
        os.environ["FLYWHEEL_DATABASE_URL"] = url
        get_settings.cache_clear()
        reset_engines()

        time.sleep(1.2)  # let every 1 s window close
        pending = scalar(url, "SELECT count(*) FROM trajectory WHERE status = 'provisional'")
        t = time.monotonic()
        done = finalize_due(projector_from_settings(), grace_s=0.0)
        finalize_s = time.monotonic() - t
        trajectories = scalar(url, "SELECT count(*) FROM trajectory")
        labels = scalar(url, "SELECT count(*) FROM reward_label")
        ratio = ours / baseline
        # The most ours could reach here: every core busy at the CPU per event it measured (consumers,
        # Postgres and broker), against the baseline as measured.
        cores = os.cpu_count() or 1
        bound = round(cores * 1e6 / extra["cpu_us_per_event"] / baseline, 3) if extra.get("cpu_us_per_event") else None
        print(
            f"# {n} events ({mean_bytes:.0f} B mean) produced at {n / produce_s:,.0f}/s; bare {baseline:,.0f}/s, "
            f"ours {ours:,.0f}/s ({args.consumers} consumer(s), {args.insert_method}; medians of {args.passes}); "
            f"{trajectories} trajectories, {pending} finalized by the sweep in {finalize_s:.2f}s",
            file=sys.stderr,
        )
        print(
            json.dumps(
                {
                    "bench": "ingest",
                    "ours": round(ours, 1),
                    "baseline": round(baseline, 1),
                    "unit": "events/s",
                    "ratio": round(ratio, 3),
                    "target": TARGET,
                    "pass": ratio >= TARGET,
                    "events": n,
                    "mean_event_bytes": round(mean_bytes),
                    "privacy_events": private,
                    "consumers": args.consumers,
                    "partitions": partitions,
                    "compression": compression,
                    "insert_method": args.insert_method,
                    "batch": max_records,
                    "trajectories": trajectories,
                    "labels": labels,
                    "finalize_s": round(finalize_s, 3),
                    "finalized_by_sweep": sum(done.values()),
                    "baseline_passes": [round(b) for b, _ in bare],
                    "ours_passes": [round(p[0]) for p in passes],
                    "pair_ratios": pair_ratios,
                    "baseline_cpu_us_per_event": round(bare_cpu_us, 1),
                    "cores": cores,
                    "ratio_cpu_bound": bound,
                    "layouts": layout_report,
                    **extra,
                }
            )
        )
        finished = True
    finally:
        for d in drops:
            d()
        stop_server()
        stop_pid(broker.pid)
        if finished:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"# broker and consumer logs kept in {tmp}", file=sys.stderr)


if __name__ == "__main__":
    main()

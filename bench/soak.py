"""Soak: the producer SDK at a steady rate into the embedded stack for minutes, across partition
rollovers and one archive pass, then every event accounted for.

Set-up: a tansu broker and an embedded Postgres started here (migrated to head), ``--consumers``
``flywheel consume`` processes in one group. ``consumers.testing.generate_stream`` makes the
sessions; each event's ``occurred_at`` is moved onto a simulated clock that runs from 23:00 three
days ago across the next ``--days`` midnights over the run (monotone in emission order, so every
session keeps its order), so the events roll from one daily partition into the next while the run
lasts. The three simulated days' partitions are created first (a fresh database has only today's
and the next three). ``EventProducer.emit`` is paced to ``--rate`` events/s.

Half-way through, the first simulated day's partition is archived as beat's pass would once past
retention (``consumers.archive.archive_due``: written to Parquet, verified, dropped) while ingest
goes on; an event stamped in that day that arrives afterwards lands in the default partition.

At the end (producer flushed, the group's stored offsets at the topic's end): ``lost`` = ids emitted
and found neither in ``event_log`` nor in the archive, ``duplicated`` = rows beyond one per id
(both sides), ingest lag = ``ingested_at`` (the batch transaction's ``now()``) minus the emit time,
p50/p99; RSS of each consumer and of this process from the end of the warm-up (``--warmup-s``) to
the end; Postgres database size growth per hour. ``pass``: nothing lost or duplicated, lag p99
under ``--max-lag-s``, no process grown by more than ``--max-rss-growth-mb``.

Flags: ``--quick`` (2 minutes), ``--duration-s`` (default 600), ``--rate`` (default 300 events/s:
sustainable on the 2-core development host beside other jobs; bench/ingest.py measures the
ceiling), ``--consumers`` (2), ``--days`` (2 rollovers).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import tempfile
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import numpy as np
import psutil
import psycopg
import pyarrow.parquet as pq

from app.core.db import reset_engines, session_scope
from app.core.migrate import upgrade
from app.core.pids import stop_pid
from app.core.settings import get_settings
from consumers.archive import archive_due
from consumers.partitions import Partition, create_partition, partition_name
from consumers.testing import consumer_process, generate_stream, scalar
from ops.broker import create_topics, start_broker
from ops.postgres import start_postgres, stop_postgres
from producers.producer import EventProducer

TOPIC = "soak.interactions"


def _rss_mb(pids: dict[str, int]) -> dict[str, float]:
    out = {}
    for name, pid in pids.items():
        try:
            out[name] = psutil.Process(pid).memory_info().rss / 2**20
        except psutil.Error:
            out[name] = float("nan")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="2 minutes")
    ap.add_argument("--duration-s", type=float, default=600.0)
    ap.add_argument("--rate", type=float, default=300.0, help="events/s the producer emits")
    ap.add_argument("--consumers", type=int, default=2)
    ap.add_argument("--days", type=int, default=2, help="simulated midnights crossed (partition rollovers)")
    ap.add_argument("--warmup-s", type=float, default=20.0)
    ap.add_argument("--max-lag-s", type=float, default=30.0)
    ap.add_argument("--max-rss-growth-mb", type=float, default=150.0)
    args = ap.parse_args()
    duration = 120.0 if args.quick else args.duration_s
    n_target = int(duration * args.rate)

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-soak-"))
    os.environ.update(
        FLYWHEEL_HOME=str(tmp),
        FLYWHEEL_TELEMETRY_EXPORTER=os.environ.get("FLYWHEEL_TELEMETRY_EXPORTER", "none"),
        FLYWHEEL_KAFKA_INTERACTIONS_TOPIC=TOPIC,
        FLYWHEEL_KAFKA_DLQ_TOPIC="soak.dlq",
        FLYWHEEL_KAFKA_CONSUMER_GROUP=f"soak-{uuid.uuid4().hex[:6]}",
    )
    broker = start_broker(tmp / "logs")
    server = start_postgres(tmp / "pgdata", database="flywheel")
    url = f"postgresql://postgres@127.0.0.1:{server.port}/flywheel"
    os.environ.update(FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap, FLYWHEEL_DATABASE_URL=url)
    get_settings.cache_clear()
    procs = []
    finished = False
    try:
        upgrade(url=url)
        create_topics(broker.bootstrap, {TOPIC: 4, "soak.dlq": 1})
        today = datetime.now(UTC).replace(hour=0, minute=0, second=0, microsecond=0)
        days = [today - timedelta(days=3 - d) for d in range(args.days + 1)]
        with psycopg.connect(url) as conn:
            for day in days:
                create_partition(conn, Partition(partition_name(day), day, day + timedelta(days=1)))
        sim_start = days[0] + timedelta(hours=23)
        sim_span = timedelta(days=args.days)

        events = generate_stream(n_target, seed=61)
        n = len(events)
        env = dict(os.environ)
        procs = [consumer_process(env, log_path=tmp / "consumers.log") for _ in range(args.consumers)]
        pids = {f"consumer_{i}": p.pid for i, p in enumerate(procs)} | {"producer": os.getpid()}
        time.sleep(8)  # the group's join (~3 s on tansu) is not ingest lag
        size0 = scalar(url, "SELECT pg_database_size(current_database())")
        emitted: dict[uuid.UUID, float] = {}
        producer = EventProducer(broker.bootstrap, TOPIC, spool_dir=tmp / "spool")
        t0 = time.time()
        rss0: dict[str, float] = {}
        archived: list = []

        def archive_first_day() -> None:  # beside the producer, as beat's pass runs beside ingest
            archived.extend(
                archive_due(session_scope, root=str(tmp / "archive"), retention_days=1, now=days[1] + timedelta(days=1))
            )

        archiver = threading.Thread(target=archive_first_day, name="archive")
        for i, e in enumerate(events):
            due = t0 + i / args.rate
            if (wait := due - time.time()) > 0:
                time.sleep(wait)
            moved = e.model_copy(update={"occurred_at": sim_start + sim_span * (i / n)})
            producer.emit(moved)
            emitted[moved.event_id] = time.time()
            if not rss0 and time.time() - t0 >= args.warmup_s:
                rss0 = _rss_mb(pids)
            if archiver.ident is None and i >= n // 2:  # the first simulated day is 23 h behind the clock
                archiver.start()
        archiver.join()
        producer.flush(timeout_s=60)
        producer.close(timeout_s=10)
        produce_s = time.time() - t0
        deadline = time.time() + 120
        while time.time() < deadline:  # the group's stored offsets commit with the events
            done = scalar(url, "SELECT coalesce(sum(next_offset), 0)::bigint FROM consumer_offset")
            if done >= n:
                break
            time.sleep(0.5)
        rss1 = _rss_mb(pids)
        size1 = scalar(url, "SELECT pg_database_size(current_database())")

        with psycopg.connect(url) as conn:
            live = conn.execute("SELECT event_id, ingested_at, tableoid::regclass::text FROM event_log").fetchall()
        rows = [(r[0], r[1].timestamp()) for r in live]
        for a in archived:
            t = pq.read_table(a.url, columns=["event_id", "ingested_at"]).to_pylist()
            rows += [(uuid.UUID(r["event_id"]), r["ingested_at"].timestamp()) for r in t]
        stored = {eid for eid, _ in rows}
        lost = len(set(emitted) - stored)
        duplicated = len(rows) - len(stored)
        lags = np.array([at - emitted[eid] for eid, at in rows if eid in emitted])
        filled = {r[2] for r in live if r[2] != "event_log_default"} | {a.name for a in archived}
        growth = {k: round(rss1[k] - rss0.get(k, rss1[k]), 1) for k in rss1}
        lag_p99 = float(np.percentile(lags, 99)) if len(lags) else float("nan")
        out = {
            "bench": "soak",
            "events": n,
            "lost": lost,
            "duplicated": duplicated,
            "lag_p50_s": round(float(np.percentile(lags, 50)), 3) if len(lags) else None,
            "lag_p99_s": round(lag_p99, 3),
            "rss_growth_mb": growth,
            "partitions_rolled": max(len(filled) - 1, 0),
            "archived_rows": sum(a.rows for a in archived),
            "default_partition_rows": sum(1 for r in live if r[2] == "event_log_default"),
            "pg_bytes_per_hour": round((size1 - size0) / (time.time() - t0) * 3600),
            "rate": args.rate,
            "achieved_rate": round(n / produce_s, 1),
            "duration_s": round(produce_s, 1),
            "consumers": args.consumers,
        }
        out["pass"] = (
            lost == 0
            and duplicated == 0
            and lag_p99 < args.max_lag_s
            and all(g < args.max_rss_growth_mb for g in growth.values())
            and out["partitions_rolled"] >= 1
            and out["archived_rows"] > 0
        )
        print(json.dumps(out))
        finished = True
    finally:
        for p in procs:
            os.killpg(p.pid, signal.SIGTERM)
        for p in procs:
            p.wait(timeout=30)
        reset_engines()
        stop_postgres(tmp / "pgdata")
        stop_pid(broker.pid)
        if finished:
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            print(f"# logs kept in {tmp}")


if __name__ == "__main__":
    main()

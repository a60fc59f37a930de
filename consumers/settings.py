"""Settings of the ingest consumer, projection and reward labeling (``FLYWHEEL_CONSUMER_*``).

Kafka connection and topic names stay in ``app.core.settings.KafkaSettings``; this module only holds
what the consumers decide: batch sizes, group timeouts, the late-signal window and the active reward
specs. Changing ``signal_window_s``/``abandon_after_s`` changes what ``flywheel replay`` rebuilds, so
replay with the settings the live consumer ran with.
"""

from __future__ import annotations

from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict

from app.core.settings import flywheel_home
from producers.events.plausibility import TimeWindow


class ConsumerSettings(BaseSettings):
    """Knobs of ``flywheel consume`` / ``finalize`` / ``relabel`` / ``replay``."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_CONSUMER_", extra="ignore", env_file_encoding="utf-8")

    batch_max_records: int = Field(
        default=2000,
        ge=1,
        le=100_000,
        description="messages per poll, i.e. per Postgres transaction (bench/ingest.py, "
        "4 consumers on 2 cores: 1000 -> ~21k events/s, 2000 -> ~24k, "
        "5000 -> ~22.5k: the first and last batches stop overlapping)",
    )
    poll_timeout_ms: int = Field(default=100, ge=0, description="longest wait for a batch to fill (ms)")
    max_poll_interval_ms: int = Field(
        default=5000,
        ge=1000,
        description="kafka-python also takes the group's rebalance timeout from this (ms); small keeps "
        "joins fast (a join waits for the rebalance timeout on tansu)",
    )
    session_timeout_ms: int = Field(default=6000, ge=1000, description="group session timeout (ms)")
    heartbeat_interval_ms: int = Field(default=1000, ge=100, description="group heartbeat interval (ms)")
    join_timeout_s: float = Field(
        default=30.0,
        gt=0,
        description="a group join unfinished after this many seconds (at least "
        "3x max_poll_interval) starts over with a new client",
    )
    fetch_max_bytes: int = Field(default=52_428_800, ge=1024, description="bytes per fetch response")
    insert_method: Literal["copy", "copy_upsert", "unnest"] = Field(
        default="copy", description="event_log batch insert (see app.repositories.events.append_events)"
    )
    signal_window_s: float = Field(
        default=3600.0,
        ge=0,
        description="seconds after session.ended (ingestion clock) during which late signals still count",
    )
    abandon_after_s: float = Field(
        default=86_400.0,
        gt=0,
        description="a session with no session.ended is finalized this many seconds after its last event",
    )
    finalize_interval_s: float = Field(
        default=5.0, gt=0, description="seconds between window-expiry sweeps in the consume loop"
    )
    finalize_grace_s: float = Field(
        default=5.0,
        ge=0,
        description="the sweep finalizes only windows closed at least this long ago (seconds), so a batch "
        "transaction that started before the close has normally committed (one that has not is "
        "redone with a later ingestion time)",
    )
    reward_specs: list[str] = Field(
        default_factory=lambda: ["implicit@1", "implicit@4"],
        description="active reward specs (name@version) labeled at finalization (the trainer trains on implicit@4; relabel compares with the first)",
    )
    reward_spec_dir: Path | None = Field(default=None, description="extra directory of reward spec TOML files")
    eval_reserve_fraction: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of tasks (hash of task_id) whose trajectories are reserved for evals",
    )
    bootstrap_timeout_ms: int = Field(
        default=10_000,
        ge=100,
        description="longest wait for the broker's first answer on start (ms); past it, the start is retried with "
        "backoff like any transient fault, until the broker answers or the consumer is stopped",
    )
    retry_max_wait_s: float = Field(
        default=10.0, gt=0, description="longest backoff between retries of a transient fault (s)"
    )
    dlq_max_bytes: int = Field(
        default=900_000,
        ge=1024,
        description="raw bytes beyond this are truncated on the DLQ topic (the table keeps them up to "
        "dead_letter_max_bytes)",
    )
    dead_letter_max_bytes: int = Field(
        default=2 * 1_048_576,
        ge=1024,
        description="a dead letter's raw bytes are stored whole up to this size (bytes); a larger record keeps "
        "only its first dead_letter_head_bytes, with its size and SHA-256",
    )
    dead_letter_head_bytes: int = Field(
        default=65_536, ge=0, description="bytes of a record over dead_letter_max_bytes kept in dead_letter.raw"
    )
    pipeline_depth: int = Field(
        default=2, ge=1, le=16, description="polled batches waiting for the DB thread before polling pauses"
    )
    shutdown_grace_s: float = Field(
        default=10.0, ge=0, description="seconds a stopping consumer waits for queued batches to commit"
    )
    max_span_links: int = Field(default=128, ge=0, description="producer trace contexts linked per batch span")
    slow_io_step_warn_s: float = Field(
        default=1.0,
        ge=0,
        description="kafka-python logs a WARNING when one step of its network loop runs longer than this (s; 0: "
        "never). Its own default, 0.1 s, fires whenever the poll thread waits that long for the GIL "
        "behind the batch thread, which is routine at full CPU and harmless next to the group's "
        "session timeout",
    )

    max_clock_skew_s: float = Field(
        default=600.0,
        ge=0,
        description="an event whose occurred_at is more than this many seconds after its ingestion time is "
        "dead-lettered as implausible (a producer clock running ahead)",
    )
    max_event_age_s: float = Field(
        default=90 * 86_400.0,
        gt=0,
        description="an event whose occurred_at is more than this many seconds before its ingestion time is "
        "dead-lettered as implausible (spooled and redriven events arrive late, not years late)",
    )
    offset_reset: Literal["earliest", "fail"] = Field(
        default="earliest",
        description="a stored offset past the end of its partition's log (the log was re-created: a local "
        "broker restarted, a topic deleted and re-created, a cluster restored) is reported at ERROR "
        "and counted; then 'earliest' re-reads the partition from its start (event_id idempotence "
        "drops what is already stored) and 'fail' stops the consumer",
    )

    def time_window(self, now: datetime) -> TimeWindow:
        """The ``occurred_at`` values plausible at ingestion time ``now`` (aware)."""
        return TimeWindow.around(now, self.max_clock_skew_s, self.max_event_age_s)

    @classmethod
    def load(cls) -> "ConsumerSettings":
        """From the environment and the local stack's env file."""
        return cls(_env_file=(flywheel_home() / "stack.env",))


@lru_cache(maxsize=1)
def get_consumer_settings() -> ConsumerSettings:
    """Process-wide consumer settings (``get_consumer_settings.cache_clear()`` re-reads)."""
    return ConsumerSettings.load()

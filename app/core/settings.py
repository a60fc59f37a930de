"""Service settings, one ``BaseSettings`` per concern, all under the ``FLYWHEEL_`` env prefix.

Resolution order (highest first): explicit environment variables, then the local stack's
``$FLYWHEEL_HOME/stack.env`` written by ``flywheel stack up``, then the defaults below. Settings are
read once per process through the cached :func:`get_settings`; tests call
``get_settings.cache_clear()`` after changing the environment.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from producers.settings import EnvSettings, KafkaSettings, flywheel_home


def secret_value(secret: SecretStr | None) -> str | None:
    """The plain value of an optional secret setting (None stays None), for the one call that sends it."""
    return secret.get_secret_value() if secret is not None else None


class DatabaseSettings(EnvSettings):
    """Postgres connection. ``url`` is a SQLAlchemy URL; the driver is forced to psycopg 3."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_DATABASE_", extra="ignore")
    url: SecretStr | None = Field(default=None, description="e.g. postgresql://user@host:5432/db")
    pool_size: int = Field(default=5, ge=1, description="connections each process keeps open")
    connect_timeout_s: int = Field(
        default=10,
        ge=2,
        description="longest wait to open a connection (s; libpq's connect_timeout, unless the URL sets one): a "
        "server that does not answer (a network partition) fails the attempt, which callers retry, "
        "instead of blocking the caller for the operating system's TCP timeout",
    )
    echo: bool = Field(default=False, description="log every SQL statement (debugging)")


class TelemetrySettings(EnvSettings):
    """OpenTelemetry exporter choice."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_TELEMETRY_", extra="ignore")
    exporter: Literal["none", "console", "otlp"] = Field(
        default="none", description="where spans (and, with otlp, metrics) go: nowhere, stdout, or an OTLP collector"
    )
    otlp_endpoint: str = Field(
        default="http://127.0.0.1:4318", description="base URL of the OTLP/HTTP collector (exporter otlp)"
    )


class LogSettings(EnvSettings):
    """How services log (``app.core.logs``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_LOG_", extra="ignore")
    format: Literal["auto", "text", "json"] = Field(
        default="auto",
        description="text lines, JSON lines (with trace_id and span_id inside a span), or auto: text when "
        "stderr is a terminal, JSON otherwise",
    )
    level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = Field(
        default="INFO", description="lowest level a service logs (any case)"
    )

    @field_validator("level", mode="before")
    @classmethod
    def _upper(cls, value: object) -> object:
        return value.upper() if isinstance(value, str) else value


class MetricsSettings(EnvSettings):
    """Where a process without its own HTTP server serves Prometheus metrics (``app.core.metrics``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_METRICS_", extra="ignore")
    port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="port of /metrics for the consumer, relay, watcher, front and Celery worker (one per "
        "process); under `flywheel up` the first of a block, each service taking this plus its place "
        "(docs/operations.md); unset: not served (the API serves /metrics on its own port)",
    )
    host: str = Field(default="127.0.0.1", description="address that port listens on (0.0.0.0 in a container)")


class CelerySettings(EnvSettings):
    """Celery broker: Redis when ``FLYWHEEL_REDIS_URL`` is set, else kombu's SQLAlchemy transport
    on the flywheel Postgres (so the embedded stack needs nothing more)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="ignore")
    redis_url: str | None = Field(
        default=None, description="Celery broker URL (Redis); unset: kombu's SQLAlchemy transport on the database"
    )
    train_interval: float = Field(default=5 * 3600.0, gt=0, description="seconds between training cycles")
    train_ready_trajectories: int | None = Field(
        default=None,
        ge=1,
        description="start a cycle as soon as this many finalized trajectories arrived since the last "
        "finished cycle and are not trained on (None: on the interval only)",
    )
    train_ready_quiet_s: float | None = Field(
        default=None,
        gt=0,
        description="also start a cycle once fewer trajectories wait, at least the cycle's "
        "data.min_new_trajectories, but none was finalized and no open session sent an event for this many "
        "seconds (a batch of traffic has ended); None: only the count and the interval start one",
    )
    train_check_interval: float = Field(
        default=60.0, gt=0, description="seconds between checks of train_ready_trajectories"
    )
    train_config: Path | None = Field(
        default=None, description="trainer TOML of scheduled cycles (default trainer/configs/default.toml)"
    )
    eval_scan_interval: float = Field(
        default=300.0, gt=0, description="seconds between scans for unevaluated candidates"
    )
    eval_mine_interval: float = Field(
        default=3600.0,
        ge=0,
        description="seconds between refreshes of the mined suite (mine sessions, verify the tasks' "
        "environments, check contamination); 0: never on the schedule",
    )
    outbox_interval: float = Field(default=2.0, gt=0, description="seconds between outbox relay runs")
    outbox_beat_relay: bool = Field(
        default=True,
        description="beat schedules the outbox relay on the worker every FLYWHEEL_OUTBOX_INTERVAL s; "
        "`flywheel up`, which runs the relay as a process of its own, turns it off for its beat",
    )
    canary_eval_interval: float = Field(
        default=60.0, gt=0, description="seconds between runs of the canary policy (end on regression, mark ready)"
    )


class StoreSettings(EnvSettings):
    """Where checkpoints and reports live."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_", extra="ignore")
    checkpoint_dir: Path | None = Field(default=None, description="default $FLYWHEEL_HOME/checkpoints")
    report_dir: Path | None = Field(default=None, description="default $FLYWHEEL_HOME/reports")

    def checkpoints(self) -> Path:
        return (self.checkpoint_dir or flywheel_home() / "checkpoints").resolve()

    def reports(self) -> Path:
        return (self.report_dir or flywheel_home() / "reports").resolve()


class EventStoreSettings(EnvSettings):
    """How ``event_log`` ages: time partitions, the dedupe window, retention and the Parquet archive."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_EVENTS_", extra="ignore")
    partition_period: Literal["day", "week"] = Field(
        default="day", description="span of one event_log partition (UTC days; weeks start on Monday)"
    )
    partitions_ahead: int = Field(
        default=3, ge=1, le=366, description="periods beat keeps created past the current one"
    )
    partition_interval: float = Field(
        default=3600.0, gt=0, description="seconds between beat's partition (create ahead) and archive passes"
    )
    dedupe_window_s: float = Field(
        default=3600.0,
        ge=0,
        description="an event id re-sent with an occurred_at this many seconds from the stored one's is a "
        "duplicate (or a conflict); a redelivery, same occurred_at, is always one",
    )
    retention_days: int | None = Field(
        default=30,
        ge=1,
        description="days a partition stays in Postgres after its range ends; then archived and dropped "
        "(empty: kept forever). Trajectories and rewards are not archived with it: they stay",
    )
    archive_url: str | None = Field(
        default=None,
        description="fsspec URL (a path, file://, s3://, gs://) archived partitions are written under; "
        "default $FLYWHEEL_HOME/archive",
    )

    def archive_root(self) -> str:
        """Where archived partitions go: :attr:`archive_url`, or ``$FLYWHEEL_HOME/archive``."""
        return self.archive_url or str(flywheel_home() / "archive")


class ServingSettings(EnvSettings):
    """Inference engine selection: the server that serves production and the one candidates' evals use."""

    # hide_input_in_errors: a refused setting never echoes the keys in its error message
    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_SERVING_", extra="ignore", hide_input_in_errors=True)
    engine: Literal["vllm", "reference"] = Field(
        default="vllm",
        description="inference backend: vllm (OpenAI-compatible servers at url and eval_url), the only production "
        "engine; reference: the in-process transformers engine, one prompt at a time (tests, hosts without vLLM)",
    )
    url: str | None = Field(
        default=None,
        description="base URL of the OpenAI-compatible server (vLLM or `flywheel serve`) that serves "
        "production; only the serving watcher moves its weights",
    )
    eval_url: str | None = Field(
        default=None,
        description="base URL of a second OpenAI-compatible server for evals: a candidate is loaded "
        "there, never on `url`; required for evals with engine vllm",
    )
    api_key: SecretStr | None = Field(
        default=None,
        description="inference key of the servers (completions, models, /weight_info): every flywheel client "
        "sends it; a server started with it refuses requests without it (401) and answers 403 when it is "
        "sent to a weight-reload route",
    )
    admin_key: SecretStr | None = Field(
        default=None,
        description="admin key of the production and canary servers' weight-reload routes (/collective_rpc, "
        "/pause, /resume, /update_weight_version, /sleep, /wake_up...): held by the serving watcher only; "
        "required with api_key to start a managed server",
    )
    eval_admin_key: SecretStr | None = Field(
        default=None,
        description="admin key of the eval server's weight-reload routes: held by the eval runner (the "
        "workers), which loads each candidate there; never opens production's",
    )
    device: Literal["auto", "cpu", "cuda"] = Field(
        default="auto", description="device of the in-process reference engine (cuda when a GPU is visible for auto)"
    )
    vllm_dtype: Literal["auto", "bfloat16", "float32"] = Field(
        default="auto",
        description="dtype of the managed vLLM servers; auto: bf16 on CUDA and on CPUs where bf16 matmuls are measured faster (app.inference.precision), else fp32",
    )
    vllm_kv_cache_gib: int = Field(
        default=2, ge=1, description="KV cache of a managed vLLM server on CPU (whole GiB, VLLM_CPU_KVCACHE_SPACE)"
    )
    vllm_max_model_len: int = Field(
        default=4096, ge=256, description="context length a managed vLLM server serves (tokens)"
    )
    vllm_enforce_eager: bool | None = Field(
        default=None,
        description="start managed vLLM servers without torch.compile; None: eager on CPU (measured: starts in "
        "34 s instead of 82 s and serves 91 % as fast), compiled on CUDA",
    )
    vllm_start_timeout_s: float = Field(
        default=900.0,
        gt=0,
        description="how long a managed vLLM server may take to answer /health after start (seconds)",
    )
    vllm_threads: int | None = Field(
        default=None, ge=1, description="OMP_NUM_THREADS of a managed vLLM server (default: vLLM's own choice)"
    )
    vllm_cpu_bind: str = Field(
        default="auto",
        pattern=r"^(auto|vllm|nobind|[0-9]+(-[0-9]+)?(,[0-9]+(-[0-9]+)?)*)$",
        description="CPUs a managed vLLM server's model threads run on (VLLM_CPU_OMP_THREADS_BIND, CPU hosts): "
        "auto: every CPU this process may use, none reserved, on hosts of at most 4 CPUs (vLLM's own choice "
        "above that); vllm: vLLM's own choice (one CPU reserved for its scheduler); nobind; or a list such as 0-1",
    )

    @model_validator(mode="after")
    def _keys_differ(self) -> "ServingSettings":
        """A key that opens two roles is no split at all: each set key must differ from the others."""
        keys = [k.get_secret_value() for k in (self.api_key, self.admin_key, self.eval_admin_key) if k is not None]
        if len(set(keys)) != len(keys):
            raise ValueError(
                "FLYWHEEL_SERVING_API_KEY, FLYWHEEL_SERVING_ADMIN_KEY and FLYWHEEL_SERVING_EVAL_ADMIN_KEY "
                "must differ from each other"
            )
        return self

    def admin_key_for(self, role: str) -> SecretStr | None:
        """The admin key of the server in ``role``: ``eval_admin_key`` for ``eval``, ``admin_key`` for
        ``production`` and ``canary`` (the servers the watcher moves)."""
        return self.eval_admin_key if role == "eval" else self.admin_key


class ApiSettings(EnvSettings):
    """Promotion API."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_API_", extra="ignore")
    host: str = Field(default="127.0.0.1", description="address `flywheel api` listens on")
    port: int = Field(default=8000, ge=0, le=65535, description="port `flywheel api` listens on")
    url: str | None = Field(default=None, description="base URL clients use; default http://host:port")
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="largest request body accepted (bytes); a larger one is answered 413"
    )


class Settings:
    """All settings of a process, one attribute per concern."""

    def __init__(self) -> None:
        self.database = DatabaseSettings.load()
        self.kafka = KafkaSettings.load()
        self.telemetry = TelemetrySettings.load()
        self.log = LogSettings.load()
        self.celery = CelerySettings.load()
        self.store = StoreSettings.load()
        self.serving = ServingSettings.load()
        self.events = EventStoreSettings.load()
        self.api = ApiSettings.load()


@lru_cache(maxsize=1)
def get_settings() -> Settings:
    """Process-wide settings, read once. Call ``get_settings.cache_clear()`` to re-read."""
    return Settings()

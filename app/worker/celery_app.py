"""The Celery app every area's tasks register on (``from app.worker.celery_app import celery_app``).

Invariants:
- The broker comes from settings, read when the configuration is first needed (sending a task or
  starting a worker), not at import: Redis when ``FLYWHEEL_REDIS_URL`` is set, else kombu's
  SQLAlchemy transport on the flywheel Postgres (tables ``kombu_queue``/``kombu_message``), so the
  embedded stack needs nothing more. Results go to the same place (Redis, or Celery's database
  backend: ``celery_taskmeta``).
- Tasks are acknowledged after they run (``acks_late``) and a worker reserves one message at a
  time, so a crashed worker's task is redelivered where the broker does so; tasks must therefore be
  idempotent (each area's task is single-flight or keyed), and eval shards do not rely on it
  (``evals.shards`` re-queues a lost worker's shard itself).
- Two queues: eval shards (``flywheel.evals.run_shard``) go to ``evals``, everything else (gating
  included) to ``celery``. A worker started without ``--queues`` consumes both; a deployment gives
  the trainer's worker ``celery`` and scales shard workers on ``evals``.
- Telemetry starts once per worker process (saleor's celeryconf habit): in each prefork child, or
  in the worker process itself for the solo/threads pools, and in beat.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from celery import Celery
from celery.signals import beat_init, setup_logging, worker_init, worker_process_init
from kombu import Exchange, Queue
from opentelemetry.instrumentation.celery import CeleryInstrumentor

from app.core.db import database_url
from app.core.settings import flywheel_home, get_settings
from app.core.telemetry import configure_service_logging, configure_telemetry
from app.worker.schedule import beat_schedule, module_available

DEFAULT_QUEUE = "celery"
EVALS_QUEUE = "evals"
TASK_MODULE_CANDIDATES = (
    "ops.tasks",
    "trainer.tasks",
    "evals.automation",
    "app.outbox.tasks",
    "app.promotion.tasks",
    "consumers.tasks",
)


def broker_urls() -> tuple[str, str]:
    """``(broker_url, result_backend)`` from settings.

    Raises:
        ConfigurationError: neither ``FLYWHEEL_REDIS_URL`` nor a database is configured.
    """
    redis = get_settings().celery.redis_url
    if redis:
        return redis, redis
    db = database_url()  # postgresql+psycopg://...
    return f"sqla+{db}", f"db+{db}"


def celery_config() -> dict[str, Any]:
    """The resolved Celery configuration (reads settings)."""
    broker, backend = broker_urls()
    sql_broker = broker.startswith("sqla+")
    return {
        "broker_url": broker,
        "result_backend": backend,
        "task_acks_late": True,
        "task_reject_on_worker_lost": True,
        "worker_prefetch_multiplier": 1,
        "task_default_queue": DEFAULT_QUEUE,
        "task_queues": tuple(Queue(q, Exchange(q), routing_key=q) for q in (DEFAULT_QUEUE, EVALS_QUEUE)),
        "task_routes": {"flywheel.evals.run_shard": {"queue": EVALS_QUEUE}},
        "task_serializer": "json",
        "result_serializer": "json",
        "accept_content": ["json"],
        "timezone": "UTC",
        "enable_utc": True,
        "result_expires": 7 * 24 * 3600,
        "broker_connection_retry_on_startup": True,
        # kombu's SQL transport hands its transport options to create_engine (so no
        # polling_interval there: it polls every 1 s); pre-ping survives a restarted Postgres.
        "broker_transport_options": {"pool_pre_ping": True} if sql_broker else {},
        "database_engine_options": {"pool_pre_ping": True},
        # Storing a task's result retries through a database restart: Celery's database backend
        # gives up after 3 retries tens of milliseconds apart, and the BackendStoreError that
        # follows ends the worker. Full-jitter backoff from 0.2 s, at most 5 s, 30 retries.
        "result_backend_always_retry": True,
        "result_backend_max_retries": 30,
        "result_backend_base_sleep_between_retries_ms": 200,
        "result_backend_max_sleep_between_retries_ms": 5000,
        "beat_schedule": beat_schedule(get_settings()),
        "beat_schedule_filename": str(flywheel_home() / "celerybeat-schedule"),
        "worker_hijack_root_logger": False,
    }


class _LazyConfig(Mapping[str, Any]):
    """Celery reads its configuration source on first use; this one calls :func:`celery_config`
    then, so importing a task module needs no database or Redis."""

    def __init__(self) -> None:
        self._data: dict[str, Any] | None = None

    def _load(self) -> dict[str, Any]:
        if self._data is None:
            self._data = celery_config()
        return self._data

    def __getitem__(self, key: str) -> Any:
        return self._load()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._load())

    def __len__(self) -> int:
        return len(self._load())


def create_celery_app(name: str = "flywheel") -> Celery:
    """A Celery app with flywheel's lazy configuration and whichever task modules are installed."""
    app = Celery(name, include=[m for m in TASK_MODULE_CANDIDATES if module_available(m)])
    app.config_from_object(_LazyConfig())
    return app


celery_app = create_celery_app()


@setup_logging.connect
def _service_logging(loglevel: int | str | None = None, **_: Any) -> None:
    # A receiver of this signal replaces Celery's own logging set-up: the worker and beat log as every
    # flywheel service does (JSON lines with the trace and span ids under FLYWHEEL_LOG_FORMAT=json).
    # `flywheel worker` and `flywheel beat` configure it first with their service's name; this names
    # a worker started with `celery -A app.worker.celery_app` directly.
    configure_service_logging(loglevel or None, service="flywheel-worker")


def _traced_tasks(service: str) -> None:
    """Telemetry for a process that runs or sends tasks: each task runs in a span (OpenTelemetry's
    Celery instrumentation), a child of the span that sent it where the sender was traced (beat's
    publish, a gate's shard), so a task's log lines carry its trace id."""
    configure_telemetry(service, metrics_port=service == "flywheel-worker")
    if not CeleryInstrumentor().is_instrumented_by_opentelemetry:
        CeleryInstrumentor().instrument()


@worker_init.connect
def _telemetry_in_worker(sender: object = None, **_: Any) -> None:
    # solo/threads pools run tasks in this process; prefork children get worker_process_init.
    pool = getattr(getattr(sender, "pool_cls", None), "__module__", "") or ""
    if "prefork" not in pool:
        _traced_tasks("flywheel-worker")


@worker_process_init.connect
def _telemetry_in_child(**_: Any) -> None:
    # The parent (consumer) process runs no task, so it holds no app engine a child could inherit.
    # The first child binds FLYWHEEL_METRICS_PORT; the others log that it is taken.
    _traced_tasks("flywheel-worker")


@beat_init.connect
def _telemetry_in_beat(**_: Any) -> None:
    _traced_tasks("flywheel-beat")

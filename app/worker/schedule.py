"""The Celery beat schedule, built from settings.

Invariant: beat only schedules tasks whose module is installed (a task name nobody registered
would pile up as "unregistered task" errors), and every periodic message expires after a few of
its periods, so a stopped worker does not come back to a backlog of stale runs.

| entry | task | every |
|---|---|---|
| train | ``flywheel.trainer.run_cycle`` | ``FLYWHEEL_TRAIN_INTERVAL`` s (5 h) |
| train-when-ready | ``flywheel.trainer.run_cycle_when_ready`` | ``FLYWHEEL_TRAIN_CHECK_INTERVAL`` s, only with ``FLYWHEEL_TRAIN_READY_TRAJECTORIES`` |
| scan-candidates | ``flywheel.evals.scan_candidates`` | ``FLYWHEEL_EVAL_SCAN_INTERVAL`` s |
| refresh-mined-suite | ``flywheel.evals.refresh_mined_suite`` | ``FLYWHEEL_EVAL_MINE_INTERVAL`` s (1 h; 0: off) |
| relay-outbox | ``flywheel.outbox.relay`` | ``FLYWHEEL_OUTBOX_INTERVAL`` s, unless ``FLYWHEEL_OUTBOX_BEAT_RELAY=false`` |
| evaluate-canary | ``flywheel.promotion.evaluate_canary`` | ``FLYWHEEL_CANARY_EVAL_INTERVAL`` s (60) |
| purge-broker-messages | ``flywheel.ops.purge_broker_messages`` | hourly, SQL broker only |
| maintain-event-partitions | ``flywheel.events.maintain_partitions`` | ``FLYWHEEL_EVENTS_PARTITION_INTERVAL`` s (1 h) |
"""

from __future__ import annotations

import importlib.util
from typing import Any

from app.core.settings import Settings, get_settings

# task name -> module that registers it
TASK_MODULES: dict[str, str] = {
    "flywheel.trainer.run_cycle": "trainer.tasks",
    "flywheel.trainer.run_cycle_when_ready": "trainer.tasks",
    "flywheel.evals.scan_candidates": "evals.automation",
    "flywheel.evals.refresh_mined_suite": "evals.automation",
    "flywheel.outbox.relay": "app.outbox.tasks",
    "flywheel.promotion.evaluate_canary": "app.promotion.tasks",
    "flywheel.ops.purge_broker_messages": "ops.tasks",
    "flywheel.events.maintain_partitions": "consumers.tasks",
}

BROKER_PURGE_INTERVAL_S = 3600.0


def module_available(name: str) -> bool:
    """Whether ``name`` can be imported (found without importing it)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def beat_schedule(settings: Settings | None = None) -> dict[str, dict[str, Any]]:
    """Celery ``beat_schedule``: entry name -> ``{"task", "schedule" (seconds), "options"}``."""
    settings = settings or get_settings()
    c = settings.celery
    entries = {
        "train": ("flywheel.trainer.run_cycle", c.train_interval),
        "scan-candidates": ("flywheel.evals.scan_candidates", c.eval_scan_interval),
        "evaluate-canary": ("flywheel.promotion.evaluate_canary", c.canary_eval_interval),
        "maintain-event-partitions": ("flywheel.events.maintain_partitions", settings.events.partition_interval),
    }
    if c.outbox_beat_relay:
        entries["relay-outbox"] = ("flywheel.outbox.relay", c.outbox_interval)
    if c.eval_mine_interval > 0:
        entries["refresh-mined-suite"] = ("flywheel.evals.refresh_mined_suite", c.eval_mine_interval)
    if c.train_ready_trajectories is not None:
        entries["train-when-ready"] = ("flywheel.trainer.run_cycle_when_ready", c.train_check_interval)
    if not c.redis_url:  # kombu's SQL transport keeps delivered rows: trim them
        entries["purge-broker-messages"] = ("flywheel.ops.purge_broker_messages", BROKER_PURGE_INTERVAL_S)
    return {
        name: {"task": task, "schedule": float(every), "options": {"expires": max(5 * float(every), 10.0)}}
        for name, (task, every) in entries.items()
        if module_available(TASK_MODULES[task])
    }

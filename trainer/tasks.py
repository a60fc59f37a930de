"""Celery task of the trainer (thin: the work is :func:`trainer.cycle.run_cycle`).

Beat calls ``flywheel.trainer.run_cycle`` every ``FLYWHEEL_TRAIN_INTERVAL`` seconds (default 5 h).
The cycle itself is single-flight (advisory lock) and skips when fewer than
``data.min_new_trajectories`` trajectories are usable, so an overlapping or early beat is harmless.
Every Celery worker imports this module at start (``app.worker.celery_app``), so the cycle (torch,
transformers) is imported inside the task.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from app.core.metrics import CYCLE_DURATION
from app.worker.celery_app import celery_app
from trainer.config import load_config


@celery_app.task(name="flywheel.trainer.run_cycle")
def run_cycle_task(config_path: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one training cycle; returns the :class:`~trainer.cycle.CycleResult` as a dict."""
    from trainer.cycle import run_cycle  # torch, transformers: loaded when a worker runs the task

    config = load_config(Path(config_path) if config_path else None, overrides)
    started, status = time.perf_counter(), "failed"
    try:
        result = run_cycle(config, progress=False)
        status = result.status
        return result.to_dict()
    finally:
        CYCLE_DURATION.record(time.perf_counter() - started, {"status": status})

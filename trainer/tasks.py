"""Celery tasks of the trainer (thin: the work is :func:`trainer.cycle.run_cycle`).

Beat starts a cycle two ways (``app.worker.schedule``): ``flywheel.trainer.run_cycle`` every
``FLYWHEEL_TRAIN_INTERVAL`` seconds (default 5 h), and, where ``FLYWHEEL_TRAIN_READY_TRAJECTORIES``
is set, ``flywheel.trainer.run_cycle_when_ready`` every ``FLYWHEEL_TRAIN_CHECK_INTERVAL`` seconds,
which starts one as soon as that many finalized trajectories are waiting
(:func:`trainer.selection.trajectories_waiting`). The cycle itself is single-flight (advisory lock)
and skips when fewer than ``data.min_new_trajectories`` trajectories are usable, so an overlapping
or early start is harmless.

A cycle that registers a candidate hands it to the gate at once (``flywheel.evals.evaluate_candidate``
by name: the trainer does not import evals); beat's ``scan-candidates`` still finds any candidate
whose message was lost. Every Celery worker imports this module at start
(``app.worker.celery_app``), so the cycle (torch, transformers) is imported inside the task.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from pathlib import Path
from typing import Any

from sqlalchemy import func, select

from app.core.db import session_scope
from app.core.metrics import CYCLE_DURATION
from app.core.settings import get_settings
from app.worker.celery_app import celery_app
from trainer.config import load_config
from trainer.selection import trajectories_waiting

log = logging.getLogger("flywheel.trainer")

GATE_TASK = "flywheel.evals.evaluate_candidate"


@celery_app.task(name="flywheel.trainer.run_cycle")
def run_cycle_task(config_path: str | None = None, overrides: dict[str, Any] | None = None) -> dict[str, Any]:
    """Run one training cycle (``FLYWHEEL_TRAIN_CONFIG`` unless ``config_path`` names another TOML)
    and send its candidate to the gate; returns the :class:`~trainer.cycle.CycleResult` as a dict."""
    from trainer.cycle import run_cycle  # torch, transformers: loaded when a worker runs the task

    path = config_path or get_settings().celery.train_config
    config = load_config(Path(path) if path else None, overrides)
    started, status = time.perf_counter(), "failed"
    try:
        result = run_cycle(config, progress=False).to_dict()
        status = result.get("status", status)
    finally:
        CYCLE_DURATION.record(time.perf_counter() - started, {"status": status})
    if status == "succeeded" and result.get("checkpoint_id"):
        celery_app.send_task(GATE_TASK, args=[result["checkpoint_id"]])
        log.info("candidate %s sent to the gate", result["checkpoint_id"])
    return result


@celery_app.task(name="flywheel.trainer.run_cycle_when_ready")
def run_cycle_when_ready() -> dict[str, Any]:
    """Run a cycle (:func:`run_cycle_task`) when at least ``FLYWHEEL_TRAIN_READY_TRAJECTORIES``
    finalized trajectories are waiting, or (with ``FLYWHEEL_TRAIN_READY_QUIET_S``) when at least the
    cycle's ``data.min_new_trajectories`` are and none was finalized for that many seconds; else
    report how many wait. Returns the cycle's result, or ``{"status": "waiting", "waiting": N,
    "ready_at": M}``."""
    celery = get_settings().celery
    with session_scope() as session:
        waiting, newest = trajectories_waiting(session)
        now = session.execute(select(func.now())).scalar_one()
    ready_at = celery.train_ready_trajectories
    min_waiting = load_config(Path(celery.train_config) if celery.train_config else None).data.min_new_trajectories
    if not cycle_due(waiting, newest, now, ready_at, celery.train_ready_quiet_s, min_waiting):
        return {"status": "waiting", "waiting": waiting, "ready_at": ready_at}
    log.info("%d finalized trajectories waiting (ready at %s): starting a cycle", waiting, ready_at)
    return run_cycle_task()


def cycle_due(
    waiting: int,
    newest: datetime | None,
    now: datetime,
    ready_at: int | None,
    quiet_s: float | None,
    min_waiting: int = 1,
) -> bool:
    """Whether ``waiting`` trajectories (the newest finalized at ``newest``) start a cycle at ``now``:
    at least ``ready_at`` of them, or at least ``min_waiting`` (the cycle's
    ``data.min_new_trajectories``) and none finalized for ``quiet_s`` seconds, so the stragglers of a
    batch finalized after its cycle selected its data wait for the next batch instead of training a
    cycle of their own. Never without ``ready_at`` (the interval schedule alone runs then)."""
    if ready_at is None or waiting == 0:
        return False
    if waiting >= ready_at:
        return True
    if waiting < min_waiting:
        return False
    return quiet_s is not None and newest is not None and (now - newest).total_seconds() >= quiet_s

"""A vLLM server brought back to what production is after it restarted on its start-up model.

Invariant: the serving watcher never leaves the production server on a checkpoint other than the one
it moved it to. A server that restarts (a crash, an OOM kill, a liveness restart) comes back on the
model it was started with and reports no weight version, and no lifecycle message would move it;
each supervision (``serving.watcher.ServingWatcher.supervise``) compares what the server reports
with what the watcher serves and reloads on a difference.
"""

from __future__ import annotations

import logging

from app.checkpoints.store import CheckpointStore
from app.core.errors import CheckpointError, InfrastructureError
from app.core.telemetry import meter
from serving.moves import resolve_dir
from serving.openai_engine import OpenAICompatEngine

log = logging.getLogger("flywheel.serving")

_reconciled = meter("flywheel.serving").create_counter(
    "flywheel.serving.reconciled", unit="{reload}", description="reloads of a server found serving another checkpoint"
)


def reconcile_served(engine: OpenAICompatEngine, store: CheckpointStore) -> bool:
    """Reload what this watcher serves into a vLLM server that reports anything else: a server that
    restarted (a crash, an OOM kill, a liveness restart) comes back on its start-up model and reports
    no weight version, and nothing on the lifecycle topic would move it. Returns whether it reloaded;
    a server that cannot answer, or a reload that fails, is logged and tried again at the next
    supervision (never fatal).
    """
    want = engine.checkpoint_id
    if not want:
        return False
    try:
        served = engine.served_checkpoint()
        if served == want:
            return False
        log.warning(
            "the production server reports %s, not %s (it restarted?): reloading %s",
            served or "no checkpoint",
            want,
            want,
        )
        engine.load_checkpoint(want, resolve_dir(None, want, store))
    except (InfrastructureError, CheckpointError) as exc:
        log.warning("could not check or reload the production server: %s", exc)
        return False
    _reconciled.add(1)
    return True

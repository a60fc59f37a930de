"""The mined suite follows production: beat's ``refresh-mined-suite`` entry mines new eval tasks from
finalized sessions, gives each an environment, and re-checks that no checkpoint trained on any
held-out task (``flywheel.evals.refresh_mined_suite``, every ``FLYWHEEL_EVAL_MINE_INTERVAL`` s).

Invariants:

- one refresh at a time across processes (a session-level advisory lock; a second one returns
  ``{"status": "busy"}`` at once);
- mining (:func:`evals.mined.mine_tasks`), the environments (:func:`evals.environment_setup.setup_environments`)
  and the contamination check (:func:`evals.mined.find_contamination`) each commit in their own
  transaction, so a refresh killed half-way keeps what it finished and the next one goes on;
- environments are proposed by the model the production server serves now (greedy, batched; no
  weights are loaded for it), verified in the sandbox on the reference solution, and fall back to
  the deterministic resolver when refused; a server that is down falls every task back, saying so;
- a mined task enters the suite the gate runs only once an environment verified for it
  (:func:`evals.tasks.mined.load_mined_tasks`), so a task whose own reference cannot pass is never
  held against a candidate;
- a contaminated task (one some checkpoint trained on) is logged at ERROR and counted in
  ``flywheel_mined_contaminated``; what to do with the checkpoint is the release manager's call.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation

from app.core.db import session_scope
from app.core.errors import ConflictError
from app.inference.engine import InferenceEngine
from evals.environment_setup import setup_environments
from evals.environments import load_policy
from evals.mined import find_contamination, mine_tasks
from evals.store import advisory_lock
from evals.tasks.mined import load_mined_tasks
from producers.telemetry import meter
from serving.engine import setup_engine

log = logging.getLogger("flywheel.evals.mined")

_last_contaminated: list[int] = []  # the count the last refresh in this process found


def _observe_contaminated(_options: CallbackOptions) -> list[Observation]:
    return [Observation(_last_contaminated[-1])] if _last_contaminated else []


_evals = meter("flywheel.evals")
MINED_TASKS = _evals.create_counter(
    "flywheel.mined.tasks", unit="{task}", description="eval tasks mined from production sessions"
)
_evals.create_observable_gauge(
    "flywheel.mined.contaminated",
    callbacks=[_observe_contaminated],
    unit="{task}",
    description="held-out tasks found in some checkpoint's training data at the last refresh",
)


def production_engine() -> InferenceEngine:
    """A client of the production server as it serves now (nothing is loaded into it)."""
    return setup_engine(role="production")


def refresh_mined_suite(
    engine_factory: Callable[[], InferenceEngine] = production_engine,
    *,
    min_persistence: float = 0.8,
    max_tokens: int = 256,
) -> dict[str, Any]:
    """Mine, set up environments, check contamination (see the module invariants).

    Args:
        engine_factory: builds the engine that proposes environments (closed afterwards).
        min_persistence: the mean kept fraction of a session's edits for it to be mined.
        max_tokens: completion tokens of one environment proposal.

    Returns:
        ``{"status": "done", "mined", "skipped", "environments": {...}, "contaminated": [...]}``,
        or ``{"status": "busy"}`` when another refresh holds the lock.

    Raises:
        sqlalchemy.exc.DBAPIError: database faults (what was committed before stays).
    """

    try:
        with advisory_lock("mined-suite", "refresh"):
            with session_scope() as session:
                mined = mine_tasks(session, min_persistence=min_persistence)
            MINED_TASKS.add(len(mined.mined))
            with session_scope() as session:
                tasks = load_mined_tasks(session, verified_only=False)
            environments: dict[str, Any] = {"tasks": 0}
            if tasks:
                engine = engine_factory()
                try:
                    with session_scope() as session:
                        report = setup_environments(session, tasks, engine, load_policy(), max_tokens=max_tokens)
                finally:
                    engine.close()
                environments = report.as_dict()
            with session_scope() as session:
                found = find_contamination(session)
    except ConflictError:
        return {"status": "busy"}
    for c in found:
        log.error("held-out task %s is in checkpoint %s's training data (via %s)", c.task_id, c.checkpoint_id, c.via)
    _last_contaminated.append(len(found))
    del _last_contaminated[:-1]
    log.info("mined suite refreshed: %d new tasks, %s", len(mined.mined), environments)
    return {
        "status": "done",
        "mined": mined.mined,
        "skipped": dict(mined.skipped),
        "environments": environments,
        "contaminated": [{"checkpoint_id": c.checkpoint_id, "task_id": c.task_id, "via": c.via} for c in found],
    }

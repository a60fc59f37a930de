"""Celery task ``flywheel.promotion.evaluate_canary``: one pass of the canary policy (beat runs it
every ``FLYWHEEL_CANARY_EVAL_INTERVAL`` seconds).

Thin: the work is :func:`app.promotion.canary_policy.evaluate_canary`, idempotent and serialised by
the production advisory lock, so overlapping runs are harmless.
"""

from __future__ import annotations

import logging

from app.core.db import session_scope
from app.promotion.canary_policy import evaluate_canary
from app.worker.celery_app import celery_app

log = logging.getLogger(__name__)


@celery_app.task(name="flywheel.promotion.evaluate_canary", ignore_result=True)
def evaluate_canary_task() -> dict:
    """Evaluate the active canary in one transaction; returns the evaluation as a dict.

    No Celery retry: a failed pass writes nothing and beat runs the next one.
    """
    with session_scope() as session:
        result = evaluate_canary(session)
    if result.outcome in ("ended", "ready"):
        log.warning("canary %s of %s %s: %s", result.canary_id, result.checkpoint_id, result.outcome, result.reasons)
    return result.as_dict()

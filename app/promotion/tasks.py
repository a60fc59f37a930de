"""Celery task ``flywheel.promotion.evaluate_canary``: one pass of the canary policy (beat runs it
every ``FLYWHEEL_CANARY_EVAL_INTERVAL`` seconds).

Thin: the work is :func:`app.promotion.canary_policy.evaluate_canary`, idempotent and serialised by
the production advisory lock, so overlapping runs are harmless. Under ``FLYWHEEL_RELEASE_POLICY=
auto_on_pass`` a ready canary's checkpoint then goes through the release policy
(:func:`app.lifecycle.release.apply_release_policy`), which promotes it on the canary's evidence.
"""

from __future__ import annotations

import logging
from dataclasses import asdict
from typing import Any

from app.core.db import session_scope
from app.lifecycle.release import ReleasePolicy, apply_release_policy, release_settings
from app.promotion.canary_policy import evaluate_canary
from app.worker.celery_app import celery_app

log = logging.getLogger(__name__)


@celery_app.task(name="flywheel.promotion.evaluate_canary", ignore_result=True)
def evaluate_canary_task() -> dict[str, Any]:
    """Evaluate the active canary in one transaction; returns the evaluation as a dict.

    No Celery retry: a failed pass writes nothing and beat runs the next one.
    """
    with session_scope() as session:
        result = evaluate_canary(session)
    if result.outcome in ("ended", "ready"):
        log.warning("canary %s of %s %s: %s", result.canary_id, result.checkpoint_id, result.outcome, result.reasons)
    out = result.as_dict()
    settings = release_settings()
    if result.outcome in ("ready", "already_ready") and settings.policy is ReleasePolicy.AUTO_ON_PASS:
        assert result.checkpoint_id is not None  # a ready canary names its checkpoint
        with session_scope() as session:  # promoting stops the canary: the next pass finds none
            out["release"] = asdict(apply_release_policy(session, result.checkpoint_id, settings))
    return out

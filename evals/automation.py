"""Celery tasks that gate new candidates: thin wrappers over :func:`evals.gating.gate_candidate`.

``flywheel.evals.evaluate_candidate(checkpoint_id)`` gates one checkpoint (enqueue it after a
``checkpoint.created``); ``flywheel.evals.scan_candidates`` (beat, every
``FLYWHEEL_EVAL_SCAN_INTERVAL`` seconds) dispatches candidates that have no gate decision yet, so a
lost trigger only delays a gate. With ``FLYWHEEL_EVAL_SHARDS`` > 1 each eval run of the gate is
split into shards (:mod:`evals.shards`): ``flywheel.evals.run_shard(run_id, shard_index)`` runs one
on any worker while the gating worker coordinates and runs shards too. Invariant: a candidate is
gated by at most one worker at a time (the gate's advisory lock); a duplicate dispatch returns
``skipped`` instead of running twice, and a duplicate shard message finds its shard claimed or
done. The task is the transaction boundary: :func:`gate_candidate` commits the decision itself,
then the release policy (``app.lifecycle.release``, ``FLYWHEEL_RELEASE_POLICY``) acts on it in its
own transaction; it is idempotent, so a redelivered task that finds the candidate decided applies
it again (completing what a crash between the two transactions left undone) and changes nothing
twice.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from app.core.db import session_scope
from app.core.errors import ConflictError
from app.lifecycle.release import ReleaseSettings, apply_release_policy, release_settings
from app.worker.celery_app import celery_app
from evals import store
from evals.config import eval_settings
from evals.gate.policy import load_gate_config
from evals.gating import gate_candidate
from evals.mined_refresh import refresh_mined_suite
from evals.shards import ShardedExecution, take_shard


def release(checkpoint_id: str, settings: ReleaseSettings | None = None) -> dict[str, Any]:
    """Apply the release policy to a decided candidate in its own transaction (idempotent).

    Returns:
        :class:`app.lifecycle.release.ReleaseAction` as a dict (``outcome``, ``reasons``...).
    """
    with session_scope() as session:
        action = apply_release_policy(session, checkpoint_id, settings or release_settings())
    return asdict(action)


def evaluate(checkpoint_id: str, *, release_policy: ReleaseSettings | None = None, **kwargs: Any) -> dict[str, Any]:
    """Gate one candidate with the ``FLYWHEEL_EVAL_*`` settings (keyword arguments override them),
    then apply the release policy (``release_policy``, default ``FLYWHEEL_RELEASE_*``).

    Returns:
        ``{"checkpoint_id", "decision_id", "passed", "decision", "failures", "report_path",
        "release"}``, or ``{"checkpoint_id", "skipped": reason, "release"?}`` when it is already
        being gated, no longer a candidate, or already decided (a decided one gets the policy again).
    """
    s = eval_settings()
    with session_scope() as session:
        decided = store.latest_decision(session, checkpoint_id)
    if decided is not None and not kwargs.pop("regate", False):
        return {
            "checkpoint_id": checkpoint_id,
            "skipped": f"already decided ({decided.id})",
            "release": release(checkpoint_id, release_policy),
        }
    opts: dict[str, Any] = {
        "config": load_gate_config(s.gate_config).with_min_pairs(s.min_pairs).gating_only(s.gate_on),
        "suites": s.gate_on,
        "limit": s.limit,
        "workers": s.workers,
        "overrides": {
            k: v for k, v in (("max_turns", s.max_turns), ("max_tokens_per_turn", s.max_tokens_per_turn)) if v
        },
    }
    if s.shards > 1:
        opts["run_kwargs"] = {
            "execute": ShardedExecution(
                shards=s.shards,
                dispatch=dispatch_shard,
                timeout_s=s.shard_timeout_s,
                max_attempts=s.shard_attempts,
                heartbeat_s=s.shard_heartbeat_s,
            )
        }
    opts.update(kwargs)
    try:
        outcome = gate_candidate(checkpoint_id, **opts)
    except ConflictError as exc:
        return {"checkpoint_id": checkpoint_id, "skipped": exc.message}
    return {
        "checkpoint_id": checkpoint_id,
        "decision_id": outcome.decision_id,
        "passed": outcome.result.passed,
        "decision": outcome.result.decision,
        "failures": [r.message for r in outcome.result.failures()],
        "report_path": outcome.report_path,
        "release": release(checkpoint_id, release_policy),
    }


def scan(dispatch: Callable[[str], Any], limit: int | None = None) -> list[str]:
    """Dispatch every STABLE candidate without a gate decision (oldest first, at most ``limit``)."""
    with session_scope() as session:
        ids = store.candidates_without_decision(session, limit=limit or eval_settings().scan_batch)
    for checkpoint_id in ids:
        dispatch(checkpoint_id)
    return ids


@celery_app.task(name="flywheel.evals.evaluate_candidate")
def evaluate_candidate(checkpoint_id: str) -> dict[str, Any]:
    """Gate ``checkpoint_id`` (see :func:`evaluate`); idempotent: a decided candidate is skipped."""
    return evaluate(checkpoint_id)


@celery_app.task(name="flywheel.evals.scan_candidates")
def scan_candidates() -> list[str]:
    """Enqueue ``evaluate_candidate`` for STABLE candidates with no gate decision."""
    return scan(lambda cid: evaluate_candidate.delay(cid))


@celery_app.task(name="flywheel.evals.refresh_mined_suite")
def refresh_mined_suite_task() -> dict[str, Any]:
    """Mine new eval tasks, set up their environments, re-check contamination
    (:func:`evals.mined_refresh.refresh_mined_suite`); a refresh already running elsewhere is skipped."""
    return refresh_mined_suite()


@celery_app.task(name="flywheel.evals.run_shard", bind=True)
def run_shard(self, run_id: str, shard_index: int) -> dict[str, Any]:
    """Claim and run one shard of an eval run (:func:`evals.shards.take_shard`); a shard that is not
    pending (done, or claimed elsewhere) is skipped, so a redelivered message is harmless."""
    s = eval_settings()
    worker = self.request.hostname or "celery"
    return take_shard(run_id, shard_index, worker=worker, workers=s.workers, heartbeat_s=s.shard_heartbeat_s)


def dispatch_shard(run_id: str, shard_index: int) -> None:
    """Enqueue ``flywheel.evals.run_shard`` for one shard (a :data:`evals.shards.ShardDispatch`)."""
    run_shard.delay(run_id, shard_index)

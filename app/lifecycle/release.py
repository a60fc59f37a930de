"""The release policy: what happens to a candidate once its gate decision is committed.

``FLYWHEEL_RELEASE_POLICY`` picks it:

- ``manual`` (the default): nothing automatic; a release manager promotes through the API
  (``POST /v1/promotions``), with a written override over ``insufficient_evidence`` or ``not_gated``.
- ``auto_on_pass``: a candidate whose gate decided ``pass`` is promoted by the audited actor
  ``release-policy`` (``FLYWHEEL_RELEASE_ACTOR``) with every check a person's promotion gets
  (the gate is against the current production, the online policy, STABLE, not trained on erased
  data); one that cannot be (a stale gate, a required canary) is held with the refusals. A
  candidate with ``insufficient_evidence`` or ``not_gated`` is held (left ``gate_failed``,
  promotable by a person with an override) unless ``FLYWHEEL_RELEASE_OVERRIDE_INSUFFICIENT`` holds a
  written reason: then it is promoted with that reason as the audited override (``gate.overridden``).
  A candidate whose gate decided ``fail`` is left as the gate left it (``gate_failed``, decision
  ``fail``): a failed gate is never promoted, the next cycle trains from production anyway, and a
  re-gate against a later production, or a person's rejection, stays possible (rejecting is final).
  Where the gate's ``[online]`` policy requires a canary and none of the candidate ran against
  this production, the policy starts one (``FLYWHEEL_RELEASE_CANARY_FRACTION`` of users, audited
  as the policy) and holds; the canary policy (``app.promotion.canary_policy``) ends it on a
  regression or marks it ready, and on ready the release policy runs again and promotes with the
  canary's evidence (a canary that is still short of its planned size holds it again, a stopped one
  that regressed refuses it for good).

Invariant: :func:`apply_release_policy` is idempotent. It acts only on a ``gate_passed`` or
``gate_failed`` checkpoint; a checkpoint already production, retired or rejected is skipped, and
a hold writes nothing, so a redelivered task changes nothing twice. It flushes inside a savepoint
of the caller's transaction (a refused promotion leaves nothing behind) and never commits.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Literal

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict
from sqlalchemy.orm import Session

from app.core.errors import ConflictError
from app.core.settings import flywheel_home
from app.lifecycle.canary import start_canary
from app.lifecycle.changes import promote_checkpoint
from app.lifecycle.online import latest_canary
from app.lifecycle.online_stats import OnlinePolicy
from app.lifecycle.production import latest_gate_decision
from app.lifecycle.status import OVERRIDABLE, CheckpointStatus, GateVerdict
from app.repositories.checkpoints import get_checkpoint

log = logging.getLogger(__name__)

ReleaseOutcome = Literal["promoted", "overridden", "canary_started", "held", "left", "skipped"]


class ReleasePolicy(StrEnum):
    """Who promotes a gated candidate."""

    MANUAL = "manual"
    """A release manager, through the API."""
    AUTO_ON_PASS = "auto_on_pass"
    """The policy promotes a passed gate (and, only when configured, overrides insufficient evidence)."""


class ReleaseSettings(BaseSettings):
    """The release policy (``FLYWHEEL_RELEASE_*``)."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_RELEASE_", extra="ignore")
    policy: ReleasePolicy = ReleasePolicy.MANUAL
    """``manual`` or ``auto_on_pass``."""
    override_insufficient: str | None = None
    """A written reason: with ``auto_on_pass``, promote over ``insufficient_evidence`` / ``not_gated``
    with it as the audited override. Unset (the default): such candidates are held for a person."""
    actor: str = "release-policy"
    """The audit log's actor of the policy's promotions."""
    canary_fraction: float = Field(default=0.1, gt=0.0, lt=1.0)
    """Share of users the canary gets that ``auto_on_pass`` starts where the online policy requires one."""


def release_settings() -> ReleaseSettings:
    """The ``FLYWHEEL_RELEASE_*`` settings (environment, then the local stack's env file)."""
    return ReleaseSettings(_env_file=(flywheel_home() / "stack.env",))


@dataclass(frozen=True)
class ReleaseAction:
    """What :func:`apply_release_policy` did.

    Attributes:
        outcome: ``promoted`` (a pass), ``overridden`` (insufficient evidence promoted with the
            configured override), ``canary_started`` (the online policy wants a canary first),
            ``held`` (left for a person), ``left`` (a failed gate),
            ``skipped`` (nothing to decide: not gated, or already production, retired or rejected).
        reasons: why it held, left or skipped (the promotion's refusals when it was refused).
        promotion_id: the promotion row when it promoted.
    """

    checkpoint_id: str
    policy: str
    outcome: ReleaseOutcome
    reasons: list[str] = field(default_factory=list)
    promotion_id: str | None = None


def apply_release_policy(session: Session, checkpoint_id: str, settings: ReleaseSettings) -> ReleaseAction:
    """Apply the release policy to a gated candidate (see the module docstring); flushes, never commits.

    Raises:
        NotFoundError: no such checkpoint.
    """

    def act(outcome: ReleaseOutcome, *reasons: str, promotion_id: str | None = None) -> ReleaseAction:
        action = ReleaseAction(checkpoint_id, settings.policy.value, outcome, list(reasons), promotion_id)
        log.info("release policy %s on %s: %s %s", settings.policy.value, checkpoint_id, outcome, "; ".join(reasons))
        return action

    row = get_checkpoint(session, checkpoint_id)
    if row.status not in (CheckpointStatus.GATE_PASSED, CheckpointStatus.GATE_FAILED):
        return act("skipped", f"status is {row.status}: nothing to release")
    if settings.policy is ReleasePolicy.MANUAL:
        return act("held", "FLYWHEEL_RELEASE_POLICY=manual: a release manager promotes through the API")
    gate = latest_gate_decision(session, checkpoint_id)
    if gate is None:  # a status set without a gate (a test fixture, an old row)
        return act("skipped", "no gate decision")
    override: str | None = None
    if gate.decision == GateVerdict.FAIL:
        return act("left", f"gate {gate.id} decided fail: a failed gate is never promoted")
    if gate.decision in OVERRIDABLE:
        if not settings.override_insufficient:
            return act(
                "held",
                f"gate {gate.id} decided {gate.decision}: held for a release manager "
                "(FLYWHEEL_RELEASE_OVERRIDE_INSUFFICIENT is not set)",
            )
        override = settings.override_insufficient
    reason = f"release policy auto_on_pass: gate {gate.id} decided {gate.decision}"
    policy = OnlinePolicy.from_config((gate.report or {}).get("config"))
    if policy.required and latest_canary(session, checkpoint_id, gate.production_id) is None:
        try:
            with session.begin_nested():
                canary = start_canary(
                    session,
                    checkpoint_id=checkpoint_id,
                    fraction=settings.canary_fraction,
                    actor=settings.actor,
                    reason=f"{reason}; the online policy requires a canary before promotion",
                )
        except ConflictError as exc:
            return act("held", *(exc.reasons or [exc.message]))
        return act(
            "canary_started",
            f"canary {canary.id} serves {settings.canary_fraction:.0%} of users; promoted once the canary "
            "policy marks it ready",
        )
    if override is not None:
        reason += " (promoted over it by FLYWHEEL_RELEASE_OVERRIDE_INSUFFICIENT)"
    try:
        with session.begin_nested():
            change = promote_checkpoint(
                session,
                checkpoint_id=checkpoint_id,
                expected_production_id=gate.production_id,
                actor=settings.actor,
                reason=reason,
                override_reason=override,
            )
    except ConflictError as exc:
        return act("held", *(exc.reasons or [exc.message]))
    outcome: ReleaseOutcome = "promoted" if override is None else "overridden"
    return act(outcome, reason, promotion_id=str(change.promotion.id))

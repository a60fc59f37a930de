"""Checkpoints touched by erased data: the flag reaches every descendant, and nothing flagged keeps
serving (the transaction behind ``consumers.erasure``'s checkpoint flagging).

Invariants (in the caller's ONE transaction, which also deletes the data):

- a checkpoint trained on erased data taints its whole subtree: it and every descendant (by
  ``parent_id``, walked level by level so a child registered while the walk runs is seen) get
  ``trained_on_erased`` and ``erasure_flagged_at``, and each newly flagged one an audit entry and
  a lifecycle message ``checkpoint.erasure_flagged`` whose ``reason`` says why (trained on it, or
  descends from the checkpoint that did); a candidate registered flagged (its data was erased
  while it trained, or its parent is flagged) gets both through :func:`record_flag`;
- the production advisory lock is taken before any flag (the order promotions take: that lock,
  then checkpoint rows), so a concurrent promotion either sees the flag and refuses, or committed
  first and is rolled back here;
- a flagged active canary is stopped (audited, ``canary.stopped``: its users return to production);
- a flagged production is rolled back through ``app.lifecycle.changes.rollback_production`` (kind
  ``rollback``, audited, ``checkpoint.rolled_back`` on the lifecycle topic, which the serving
  watcher follows) to the newest ancestor that is clean, STABLE and served before; when there is
  none, an ERROR is logged and an audit entry ``production.erasure_unresolved`` names the
  production and every ancestor refused, for a release manager to act on. The erasure itself
  always commits: the data is gone whatever serves.

Functions flush and never commit.
"""

from __future__ import annotations

import logging
from collections.abc import Collection
from dataclasses import dataclass, field

from sqlalchemy import select, text
from sqlalchemy.orm import Session

from app.lifecycle.canary import get_active_canary, stop_canary
from app.lifecycle.changes import ProductionChange, earlier_productions, rollback_production
from app.lifecycle.messages import ErasureFlagged
from app.lifecycle.production import is_stable, lineage, lock_production
from app.lifecycle.status import CheckpointStatus
from app.models import Checkpoint
from app.outbox.lifecycle import enqueue_lifecycle
from app.repositories.audit import record_audit

log = logging.getLogger(__name__)

FLAG_ACTION = "checkpoint.erasure_flagged"
UNRESOLVED_ACTION = "production.erasure_unresolved"
TRAINED_ON_ERASED = "trained on data of an erased user"


@dataclass
class FlagOutcome:
    """What flagging a set of checkpoints changed.

    Attributes:
        flagged: every checkpoint of the subtrees (direct and descendants, flagged before or now), sorted.
        newly_flagged: those this call flagged, sorted.
        rollback: the production change made, when production was flagged and an ancestor could serve.
        unresolved: why production stays on a flagged checkpoint (empty when it does not).
    """

    flagged: list[str] = field(default_factory=list)
    newly_flagged: list[str] = field(default_factory=list)
    rollback: ProductionChange | None = None
    unresolved: list[str] = field(default_factory=list)


def lock_before_flagging(session: Session) -> None:
    """Take the production advisory lock (before the caller's first checkpoint flag, see the invariants)."""
    lock_production(session)


def _flag(session: Session, ids: Collection[str]) -> list[str]:
    """Flag the unflagged among ``ids``; returns the ones this statement flagged."""
    return list(
        session.execute(
            text(
                "UPDATE checkpoint SET trained_on_erased = true, erasure_flagged_at = coalesce(erasure_flagged_at, now()) "
                "WHERE id = ANY(:ids) AND NOT trained_on_erased RETURNING id"
            ),
            {"ids": sorted(ids)},
        ).scalars()
    )


def flag_subtrees(session: Session, direct: Collection[str], *, actor: str, cause: str) -> FlagOutcome:
    """Flag ``direct`` (checkpoints that trained on erased data) and all their descendants, stop a
    flagged canary and move production off a flagged checkpoint (see the module invariants).

    Args:
        direct: ids of the checkpoints that trained on the erased data.
        actor: who acts (the audit entries' actor), e.g. ``consumers:erasure``.
        cause: what erased the data, for the reasons (e.g. ``erasure request req-1``).

    Raises:
        sqlalchemy.exc.DBAPIError: database faults (the caller's transaction rolls back as a whole).
    """
    out = FlagOutcome()
    if not direct:
        return out
    lock_before_flagging(session)
    reasons: dict[str, tuple[str, str | None]] = {}
    for cid in _flag(session, direct):
        reasons[cid] = (f"{TRAINED_ON_ERASED} ({cause})", None)
    # Level by level, each level a new statement: a child committed meanwhile (its registration
    # waited on its parent's flag) is seen by the next level's query.
    seen, frontier, parents = set(direct), set(direct), dict[str, str]()
    while frontier:
        children: dict[str, str] = dict(
            session.execute(
                text("SELECT id, parent_id FROM checkpoint WHERE parent_id = ANY(:ids)"), {"ids": sorted(frontier)}
            ).all()
        )
        parents.update(children)
        frontier = set(children) - seen
        seen |= frontier
        for cid in _flag(session, frontier):
            nearest = _source(cid, parents, set(direct))
            reasons[cid] = (f"descends from {nearest}, which was {TRAINED_ON_ERASED} ({cause})", nearest)
    for cid in sorted(reasons):
        reason, source = reasons[cid]
        record_flag(session, cid, actor=actor, reason=reason, cause=cause, inherited_from=source)
    out.flagged, out.newly_flagged = sorted(seen), sorted(reasons)
    if out.newly_flagged:
        log.warning("flagged %d checkpoint(s) trained on erased data or descended from one: %s", len(reasons), reasons)
    canary = get_active_canary(session, for_update=True)
    if canary is not None and canary.checkpoint_id in seen:
        stop_canary(
            session,
            actor=actor,
            reason=f"canary checkpoint {canary.checkpoint_id} is flagged: {_why(session, canary.checkpoint_id)}",
            canary_id=canary.id,
        )
    production = session.scalars(
        select(Checkpoint.id).where(Checkpoint.status == CheckpointStatus.PRODUCTION)
    ).one_or_none()
    if production in seen:
        out.rollback, out.unresolved = leave_flagged_production(session, actor=actor)
    return out


def record_flag(
    session: Session, checkpoint_id: str, *, actor: str, reason: str, cause: str | None, inherited_from: str | None
) -> None:
    """The audit entry and the ``checkpoint.erasure_flagged`` message of a checkpoint just flagged
    ``trained_on_erased`` (the caller set the flag), telling a release manager why; flushes."""
    details = {"reason": reason, "cause": cause, "inherited_from": inherited_from}
    record_audit(session, actor=actor, action=FLAG_ACTION, target=f"checkpoint:{checkpoint_id}", details=details)
    message = ErasureFlagged(
        checkpoint_id=checkpoint_id, actor=actor, reason=reason, cause=cause, inherited_from=inherited_from
    )
    enqueue_lifecycle(session, message)


def _source(checkpoint_id: str, parents: dict[str, str], direct: set[str]) -> str:
    """The nearest ancestor of ``checkpoint_id`` among ``direct`` (``parents``: child -> parent as walked)."""
    node = parents[checkpoint_id]
    while node not in direct:
        node = parents[node]
    return node


def _why(session: Session, checkpoint_id: str) -> str:
    """The reason of the newest ``checkpoint.erasure_flagged`` entry of a checkpoint."""
    return erasure_reasons(session, [checkpoint_id]).get(checkpoint_id, TRAINED_ON_ERASED)


def erasure_reasons(session: Session, checkpoint_ids: Collection[str]) -> dict[str, str]:
    """``{checkpoint id: reason}`` of the newest ``checkpoint.erasure_flagged`` audit entry of each
    (flagged checkpoints only; one flagged before those entries existed has none)."""
    if not checkpoint_ids:
        return {}
    rows = session.execute(
        text(
            "SELECT DISTINCT ON (target) target, details->>'reason' FROM audit_log "
            "WHERE action = :action AND target = ANY(:targets) ORDER BY target, id DESC"
        ),
        {"action": FLAG_ACTION, "targets": [f"checkpoint:{c}" for c in checkpoint_ids]},
    ).all()
    return {target.removeprefix("checkpoint:"): reason for target, reason in rows}


def leave_flagged_production(session: Session, *, actor: str) -> tuple[ProductionChange | None, list[str]]:
    """Roll a flagged production back to its newest ancestor that is clean, STABLE and was production
    before (the rollback's own conditions, checked first so no refusal is needed); with none, log
    an ERROR and audit ``production.erasure_unresolved``.

    Returns:
        (the rollback, or None; why no ancestor could serve, empty after a rollback).
    """
    current = lock_production(session)
    if current is None:
        return None, []
    session.refresh(current)  # the flag was set by SQL this transaction: not in the loaded object
    if not current.trained_on_erased:
        return None, []
    why = _why(session, current.id)
    served, refused = earlier_productions(session), []
    for row in lineage(session, current.id)[1:]:
        session.refresh(row)
        problems = []
        if row.trained_on_erased:
            problems.append("flagged too")
        if row.id not in served:
            problems.append("never production")
        elif row.status != CheckpointStatus.RETIRED:
            problems.append(f"status {row.status!r}")
        if not is_stable(row):
            problems.append(f"not STABLE at {row.path}")
        if problems:
            refused.append(f"{row.id}: {', '.join(problems)}")
            continue
        skipped = f" (ancestors passed over: {'; '.join(refused)})" if refused else ""
        reason = (
            f"production {current.id} is flagged: {why}; rolled back to {row.id}, its newest ancestor "
            f"that is clean, STABLE and served before{skipped}"
        )
        change = rollback_production(
            session, expected_production_id=current.id, actor=actor, reason=reason, checkpoint_id=row.id
        )
        log.warning("%s", reason)
        return change, []
    refused = refused or ["it has no ancestor"]
    message = (
        f"production {current.id} is flagged ({why}) and KEEPS SERVING: no ancestor can replace it "
        f"({'; '.join(refused)}); promote a clean checkpoint or roll back by hand"
    )
    log.error("%s", message)
    record_audit(
        session,
        actor=actor,
        action=UNRESOLVED_ACTION,
        target=f"checkpoint:{current.id}",
        details={"reason": message, "refused": refused},
    )
    return None, refused

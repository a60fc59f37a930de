"""The rows every production and canary change reads first: production and a checkpoint under their
locks, a candidate's latest gate decision, STABLE, the lineage, and the lineage fields a lifecycle
message carries for the serving watcher.

Invariant: a production or canary change takes :func:`lock_production` (a transaction-scoped
advisory lock, then the production row ``FOR UPDATE``) before it locks any checkpoint row
(:func:`lock_checkpoint`), so concurrent changes queue in one order and never deadlock.

Functions flush and never commit. This module imports no other ``app.lifecycle`` writer: the
production changes, the canary and the erasure flags all build on it.
"""

from __future__ import annotations

from pathlib import Path

from sqlalchemy import literal, select, text
from sqlalchemy.orm import Session

from app.core.errors import NotFoundError
from app.core.locks import AdvisoryLock
from app.lifecycle.messages import LineageEntry
from app.models import Checkpoint, GateDecision
from app.models.checkpoints import STABLE_MARKER
from app.repositories.checkpoints import get_production

MAX_LINEAGE = 256


def lock_production(session: Session) -> Checkpoint | None:
    """Take the production advisory lock (until the transaction ends), then lock and return the
    production row (None when there is no production)."""
    session.execute(text("SELECT pg_advisory_xact_lock(:k)"), {"k": AdvisoryLock.PRODUCTION})
    return get_production(session, for_update=True)


def lock_checkpoint(session: Session, checkpoint_id: str) -> Checkpoint:
    """The checkpoint row, locked ``FOR UPDATE`` and refreshed from the database.

    Raises:
        NotFoundError: no such checkpoint.
    """
    row = session.scalars(
        select(Checkpoint)
        .where(Checkpoint.id == checkpoint_id)
        .with_for_update()
        .execution_options(populate_existing=True)
    ).one_or_none()
    if row is None:
        raise NotFoundError(f"checkpoint {checkpoint_id!r} not found")
    return row


def latest_gate_decision(session: Session, checkpoint_id: str) -> GateDecision | None:
    """The most recent gate decision for a candidate, or None."""
    return session.scalars(
        select(GateDecision)
        .where(GateDecision.candidate_id == checkpoint_id)
        .order_by(GateDecision.created_at.desc(), GateDecision.id.desc())
        .limit(1)
    ).first()


def stale_gate_reason(gate: GateDecision, current: Checkpoint | None) -> str | None:
    """Why ``gate`` no longer speaks for a change against production ``current`` (it compared the
    candidate with another checkpoint), or None."""
    if current is not None and gate.production_id != current.id:
        return f"the gate compared against {gate.production_id}, but production is now {current.id}: re-run the gate"
    return None


def is_stable(row: Checkpoint) -> bool:
    """Whether the row says STABLE and the directory still carries the ``STABLE`` marker."""
    return bool(row.stable) and (Path(row.path) / STABLE_MARKER).exists()


def check_clean(row: Checkpoint, reasons: list[str]) -> None:
    """Append the refusals of a checkpoint that may not serve: not STABLE, or trained on erased data."""
    if not is_stable(row):
        reasons.append(f"checkpoint directory is not STABLE at {row.path}")
    if row.trained_on_erased:
        reasons.append("checkpoint trained on data of an erased user")


def lineage(session: Session, checkpoint_id: str, limit: int = MAX_LINEAGE) -> list[Checkpoint]:
    """The checkpoint and its ancestors, child first (a recursive CTE over ``parent_id``)."""
    chain = (
        select(Checkpoint.id, Checkpoint.parent_id, literal(1).label("depth"))
        .where(Checkpoint.id == checkpoint_id)
        .cte("chain", recursive=True)
    )
    parent = (
        select(Checkpoint.id, Checkpoint.parent_id, (chain.c.depth + 1).label("depth"))
        .join(chain, Checkpoint.id == chain.c.parent_id)
        .where(chain.c.depth < limit)
    )
    chain = chain.union_all(parent)
    ids = [r.id for r in session.execute(select(chain.c.id, chain.c.depth).order_by(chain.c.depth))]
    rows = {r.id: r for r in session.scalars(select(Checkpoint).where(Checkpoint.id.in_(ids)))}
    return [rows[i] for i in ids if i in rows]


def serving_lineage(session: Session, row: Checkpoint) -> list[LineageEntry]:
    """Where each checkpoint of ``row``'s lineage lives, child first: with the row's path and parent,
    what a follower needs to find ``row``'s folder without a database."""
    return [LineageEntry(id=c.id, path=c.path) for c in lineage(session, row.id)]

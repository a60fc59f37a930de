"""Record isolation: a batch that fails for a reason other than a transient fault is applied again,
bisected in savepoints, until each record at fault is alone; that record becomes a
``processing_error`` dead letter and every other record of the batch is applied.

Invariant: the whole batch is settled in ONE transaction (its offsets included), as
``consumers.batch.apply_batch`` settles it; a transient fault at any depth propagates, so the caller
retries the whole isolation pass and nothing is half-kept.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.retry import is_transient
from consumers.batch import apply_batch
from consumers.classify import Decoded
from consumers.counts import BatchOutcome
from consumers.projection import Projector

log = logging.getLogger(__name__)


def apply_isolated(
    group_id: str,
    decoded: list[Decoded],
    projector: Projector,
    *,
    before_commit: Callable[[Session, BatchOutcome], None] = lambda s, o: None,
) -> tuple[BatchOutcome, int]:
    """Apply ``decoded`` record-isolated in a new transaction: O(k log n) savepoints for k bad records
    in n. ``before_commit(session, outcome)`` runs last in the transaction (the consumer publishes the
    batch's dead letters there, as with a batch applied whole).

    Returns:
        (the batch's outcome, how many records were dead-lettered as ``processing_error``).
    Raises:
        Exception: a transient fault (``app.core.retry.is_transient``); nothing was committed.
    """
    total = BatchOutcome(messages=len(decoded))
    errors = [0]

    def bisect(session: Session, part: list[Decoded]) -> None:
        try:
            with session.begin_nested():  # conflict-safe insert: see append_events
                total.merge(apply_batch(session, group_id, part, projector, "copy_upsert"))
            return
        except Exception as exc:  # noqa: BLE001 -- route the bad record, keep the batch going
            if is_transient(exc):
                raise
            if len(part) > 1:
                mid = len(part) // 2
                bisect(session, part[:mid])
                bisect(session, part[mid:])
                return
            d = part[0]
            log.error(
                "record %s:%s:%s failed (%s: %s); dead-lettering it",
                d.msg.topic,
                d.msg.partition,
                d.msg.offset,
                type(exc).__name__,
                exc,
            )
            bad = Decoded(d.msg, reason="processing_error", detail=f"{type(exc).__name__}: {exc}"[:2000])
        with session.begin_nested():
            total.merge(apply_batch(session, group_id, [bad], projector, "copy_upsert"))
        errors[0] += 1

    with session_scope() as session:
        bisect(session, decoded)
        before_commit(session, total)
    return total, errors[0]

"""Dead letters after the fact: counts by reason, listing, and redrive.

A redrive publishes chosen dead letters' raw bytes (with their key and headers) back to their source
topic, typically after a consumer fix for ``processing_error`` ones, or after a producer bug was
fixed upstream and the contract now admits what it sent.

Invariants:

- A redrive decides nothing itself: the ingest consumer classifies the records again. A valid event
  that is already stored is a duplicate (``event_id``); a record still invalid becomes a new dead
  letter at its new offset, whose ``flywheel-redrive-of`` header names the row it came from.
- At least once: rows are selected ``FOR UPDATE SKIP LOCKED`` (two operators redriving at once split
  them) and marked ``redriven_at`` in the same transaction, only after the broker acknowledged every
  record of the batch. A failure leaves the batch unmarked; running again publishes it again, which
  the consumer deduplicates.
- Rows without bytes (an erasure covered them, their session is in privacy mode, or the message
  had no value) are never published, nor rows that keep only the record's head (``raw_size``
  past the bytes kept), nor oversized ones (the consumer would refuse them again): all are counted
  as skipped.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kafka.errors import KafkaError
from sqlalchemy.orm import Session

from app.core.db import session_scope
from app.core.errors import InfrastructureError
from app.core.settings import get_settings
from app.repositories.events import raw_connection
from consumers.deadletter import DeadLetterPublisher, stored_headers

REDRIVE_HEADER = "flywheel-redrive-of"
"""Header a redriven record carries: ``topic:partition:offset`` of the dead letter it came from."""


@dataclass
class RedriveReport:
    """What a redrive did (or, with ``dry_run``, would do)."""

    selected: int = 0
    """Rows matching the selection (never redriven ones only, unless ``again``)."""
    published: int = 0
    """Records the broker acknowledged (with ``dry_run``: that would be published)."""
    skipped: Counter[str] = field(default_factory=Counter)
    """Rows not published, by why: ``no_bytes``, ``oversized``."""
    ids: list[int] = field(default_factory=list)
    """``dead_letter.id`` of the published rows."""
    dry_run: bool = False

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready."""
        return {
            "selected": self.selected,
            "published": self.published,
            "skipped": dict(self.skipped),
            "ids": self.ids,
            "dry_run": self.dry_run,
        }


def dead_letter_stats(session: Session) -> list[dict[str, Any]]:
    """Dead letters by reason, most first: ``reason``, ``count``, ``pending`` (never redriven),
    ``first_at`` and ``last_at`` (when the first and last were stored)."""
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT reason, count(*), count(*) FILTER (WHERE redriven_at IS NULL), min(created_at), "
            "max(created_at) FROM dead_letter GROUP BY reason ORDER BY 2 DESC, 1"
        )
        return [
            {"reason": r, "count": n, "pending": p, "first_at": a.isoformat(), "last_at": b.isoformat()}
            for r, n, p, a, b in cur.fetchall()
        ]


def list_dead_letters(
    session: Session, *, reason: str | None = None, pending_only: bool = False, limit: int = 50, after_id: int = 0
) -> list[dict[str, Any]]:
    """Dead letters in ``id`` order (oldest first) after ``after_id``, at most ``limit``: position,
    reason, ``detail`` (first 300 characters), claimed ``user_id`` and ``session_id``, ``bytes`` (raw
    length; None when the bytes are not kept), ``redacted`` (why not: ``erasure`` | ``privacy``),
    ``created_at``, ``redriven_at``."""
    where: list[str] = ["id > %s"]
    params: list[object] = [after_id]
    if reason:
        where.append("reason = %s")
        params.append(reason)
    if pending_only:
        where.append("redriven_at IS NULL")
    with raw_connection(session).cursor() as cur:
        cur.execute(
            f'SELECT id, topic, partition, "offset", reason, left(detail, 300), user_id, session_id, '
            f"length(raw), redacted, created_at, redriven_at FROM dead_letter WHERE {' AND '.join(where)} "
            "ORDER BY id LIMIT %s",
            (*params, limit),
        )
        return [
            {
                "id": i,
                "topic": t,
                "partition": p,
                "offset": o,
                "reason": r,
                "detail": d,
                "user_id": u,
                "session_id": sid,
                "bytes": n,
                "redacted": why,
                "created_at": c.isoformat(),
                "redriven_at": x.isoformat() if x else None,
            }
            for i, t, p, o, r, d, u, sid, n, why, c, x in cur.fetchall()
        ]


def redrive_headers(stored: list[list[str]] | None, source: str) -> list[tuple[str, bytes]]:
    """The headers a redriven record carries: the stored ones (without an earlier redrive's
    :data:`REDRIVE_HEADER`) plus :data:`REDRIVE_HEADER` = ``source``."""
    out = [(k, v) for k, v in stored_headers(stored) if k != REDRIVE_HEADER]
    out.append((REDRIVE_HEADER, source.encode()))
    return out


def redrive(
    *,
    reasons: Sequence[str] = (),
    ids: Sequence[int] = (),
    select_all: bool = False,
    again: bool = False,
    dry_run: bool = False,
    topic: str | None = None,
    bootstrap: str | None = None,
    max_bytes: int | None = None,
    batch: int = 500,
    timeout_s: float = 30.0,
) -> RedriveReport:
    """Publish the selected dead letters' raw bytes back to their source topic (or ``topic``).

    Selection: rows whose reason is in ``reasons`` or whose id is in ``ids``, or every row with
    ``select_all``; only rows never redriven unless ``again``.

    Args:
        max_bytes: larger raw records are skipped as ``oversized``; default
            ``FLYWHEEL_KAFKA_MAX_EVENT_BYTES``.
        batch: rows per transaction (published, acknowledged, then marked).
        timeout_s: longest wait for the broker's acknowledgements of one batch (seconds).

    Raises:
        ValueError: an empty selection (no reasons, no ids, not ``select_all``).
        InfrastructureError: the broker did not acknowledge a batch; that batch is not marked, the
            ones before it are.
    """
    if not (reasons or ids or select_all):
        raise ValueError("choose what to redrive: reasons, ids or select_all")
    kafka = get_settings().kafka
    max_bytes = max_bytes or kafka.max_event_bytes
    report = RedriveReport(dry_run=dry_run)
    where = "TRUE" if select_all else "(reason = ANY(%(reasons)s) OR id = ANY(%(ids)s))"
    if not again:
        where += " AND redriven_at IS NULL"
    params: dict[str, Any] = {"reasons": list(reasons), "ids": list(ids), "batch": batch, "after": 0}
    publisher = None
    try:
        while True:
            with session_scope() as session:
                with raw_connection(session).cursor() as cur:
                    cur.execute(
                        f'SELECT id, topic, partition, "offset", key, raw, headers, raw_size FROM dead_letter '
                        f"WHERE id > %(after)s AND {where} ORDER BY id LIMIT %(batch)s "
                        f"FOR UPDATE SKIP LOCKED",
                        params,
                    )
                    rows = cur.fetchall()
                    if not rows:
                        break
                    params["after"] = rows[-1][0]
                    report.selected += len(rows)
                    chosen = []
                    for row in rows:
                        raw = row[5]
                        if not raw:
                            report.skipped["no_bytes"] += 1
                        elif row[7] is not None and row[7] > len(raw):  # only the head is kept
                            report.skipped["truncated"] += 1
                        elif len(raw) > max_bytes:
                            report.skipped["oversized"] += 1
                        else:
                            chosen.append(row)
                    if not chosen:
                        continue
                    if not dry_run:
                        publisher = publisher or _publisher(bootstrap or kafka.bootstrap, max_bytes)
                        _publish(publisher, chosen, topic, timeout_s)
                        cur.execute(
                            "UPDATE dead_letter SET redriven_at = now() WHERE id = ANY(%s)", ([r[0] for r in chosen],)
                        )
                    report.published += len(chosen)
                    report.ids += [r[0] for r in chosen]
    finally:
        if publisher is not None:
            publisher.close()
    return report


def _publisher(bootstrap: str | None, max_bytes: int) -> DeadLetterPublisher:
    if not bootstrap:
        raise InfrastructureError("no Kafka bootstrap: set FLYWHEEL_KAFKA_BOOTSTRAP")
    return DeadLetterPublisher(bootstrap, topic=None, max_bytes=max_bytes, client_id="flywheel-redrive")


def _publish(publisher: DeadLetterPublisher, rows: list[tuple[Any, ...]], topic: str | None, timeout_s: float) -> None:
    try:
        publisher.send(
            (
                (topic or t, key, bytes(raw), redrive_headers(headers, f"{t}:{p}:{o}"))
                for _, t, p, o, key, raw, headers, _size in rows
            ),
            timeout_s,
        )
    except KafkaError as exc:
        raise InfrastructureError(
            f"the broker did not acknowledge the redrive ({exc}); this batch of "
            f"{len(rows)} is not marked: run the redrive again"
        ) from exc

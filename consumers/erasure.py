"""Right to erasure: delete a user's events, trajectories and dead letters; flag checkpoints.

Invariants:

- ``event_log`` rows are deleted only here, inside the caller's transaction, with
  ``SET LOCAL flywheel.erasure = 'on'`` (the append-only trigger refuses any other DELETE).
- Every checkpoint that trained on one of the user's trajectories (``checkpoint_trajectory``, which
  the trainer writes from its manifest and keeps after erasure) gets ``trained_on_erased = true``
  and ``erasure_flagged_at``; nothing else about the checkpoint changes (a release manager decides).
- The request is stored minimally: one ``erasure_request`` row (request id, pseudonymous user id,
  counts, affected trajectory ids and checkpoints, when it was requested). The request event is
  not put in ``event_log``, and its free-text ``reason`` is not kept.
- Across partitions: a user's other sessions may sit in partitions consumed later, so the ingest
  batch drops any event of a user whose ``occurred_at`` is at or before a processed request's
  ``requested_at`` (``app.repositories.events.erased_users``). Events after it are new data.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from datetime import datetime

from sqlalchemy.orm import Session

from app.repositories.events import raw_connection


@dataclass
class ErasureOutcome:
    """What one erasure removed and flagged."""

    request_id: str
    user_id: str
    events_deleted: int = 0
    trajectories_deleted: int = 0
    dead_letters_deleted: int = 0
    trajectory_ids: list[uuid.UUID] = field(default_factory=list)
    checkpoints_flagged: list[str] = field(default_factory=list)
    already_done: bool = False


def erase_user(session: Session, user_id: str, request_id: str, requested_at: datetime) -> ErasureOutcome:
    """Erase ``user_id`` in the caller's transaction (idempotent per ``request_id``).

    Raises:
        psycopg.Error: database faults (the caller's transaction rolls back as a whole).
    """
    out = ErasureOutcome(request_id=request_id, user_id=user_id)
    conn = raw_connection(session)
    with conn.cursor() as cur:
        cur.execute("SELECT 1 FROM erasure_request WHERE request_id = %s", (request_id,))
        if cur.fetchone():
            out.already_done = True
            return out
        cur.execute("SELECT set_config('flywheel.erasure', 'on', true)")
        cur.execute("DELETE FROM event_log WHERE user_id = %s", (user_id,))
        out.events_deleted = cur.rowcount
        cur.execute("SELECT set_config('flywheel.erasure', 'off', true)")
        cur.execute("DELETE FROM trajectory WHERE user_id = %s RETURNING id", (user_id,))  # cascades
        out.trajectory_ids = sorted(r[0] for r in cur.fetchall())
        out.trajectories_deleted = len(out.trajectory_ids)
        # Dead letters are raw bytes: remove any that carries the user id as a JSON string.
        cur.execute("DELETE FROM dead_letter WHERE position(%s::bytea in raw) > 0",
                    (b'"' + user_id.encode() + b'"',))
        out.dead_letters_deleted = cur.rowcount
        cur.execute(
            "UPDATE checkpoint SET trained_on_erased = true, erasure_flagged_at = coalesce(erasure_flagged_at, now()) "
            "WHERE id IN (SELECT checkpoint_id FROM checkpoint_trajectory WHERE user_id = %s "
            "OR trajectory_id = ANY(%s)) RETURNING id", (user_id, out.trajectory_ids))
        out.checkpoints_flagged = sorted(r[0] for r in cur.fetchall())
        cur.execute(
            "INSERT INTO erasure_request (request_id, user_id, events_deleted, trajectories_deleted, trajectory_ids, "
            "checkpoints_flagged, dead_letters_deleted, requested_at) VALUES (%s, %s, %s, %s, %s, %s, %s, %s)",
            (request_id, user_id, out.events_deleted, out.trajectories_deleted, out.trajectory_ids,
             out.checkpoints_flagged, out.dead_letters_deleted, requested_at))
    return out

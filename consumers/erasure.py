"""Right to erasure: delete a user's events, trajectories and dead letters; flag checkpoints.

Invariants:

- ``event_log`` rows are deleted only here, inside the caller's transaction, with
  ``SET LOCAL flywheel.erasure = 'on'`` (the append-only trigger refuses any other DELETE).
- The archive too: the user's sessions include those of archived days, and every archived Parquet
  file holding the user's rows of them is rewritten without them in the same transaction, each
  rewrite audited (``consumers.archive.erase_archived``; ``events_deleted`` counts both). A
  rewritten file stays rewritten if the transaction then rolls back; the retry finds less to do.
- Every checkpoint that trained on one of the user's trajectories (``checkpoint_trajectory``, which
  the trainer writes from its manifest and keeps after erasure), and every descendant of one, gets
  ``trained_on_erased = true`` and ``erasure_flagged_at`` with an audited reason (one still
  training when the erasure commits is flagged by its registration, ``trainer.records``). In the
  same transaction a flagged canary is stopped and a flagged production is rolled back to its
  newest clean ancestor, or, with none, reported as an ERROR and an audit entry
  (``app.lifecycle.erasure``).
- Eval tasks mined from a deleted trajectory (``eval_task.source_trajectory_id``, ``evals.mined``)
  are deleted with it: they hold its session's request text and test. Past eval results keep only
  the task id and outcomes.
- Dead letters: those whose raw JSON claims the user (``dead_letter.user_id``, indexed), and any
  unattributed one (not JSON, oversized, no usable ``user_id``) whose bytes carry the quoted user
  id. A dead letter that claims another user is that user's, even if it mentions this one.
- A request is identified by what it erases: (user id, request id). Every request is applied
  whenever it arrives, the same pair again included: it erases everything of the user up to its
  own ``requested_at`` (a user who came back after the first request loses the newer sessions
  too), and applying it again only finds less or nothing to delete. A repeat is logged at INFO
  with what it deleted (``repeated``); a request id already used for another user is a new
  request, logged at WARNING (``reused_by``). No request is skipped for its id.
- The request is stored minimally: one ``erasure_request`` row per (request id, user id),
  pseudonymous, with counts, affected trajectory ids and checkpoints (a repeat adds to them) and
  the latest time it was requested. The request event is not put in ``event_log``, and its
  free-text ``reason`` is not kept.
- What a request covers: every session of the user with an event at or before ``requested_at``
  (the request's ``occurred_at``), whole. A session entirely after it is new data and stays.
- Across partitions: a user's sessions may sit in partitions consumed later, so the ingest batch
  drops an event of an erased user if it occurred at or before the request, or belongs to an
  erased session (its trajectory id, ``uuid5(session_id)``, is in the request's
  ``trajectory_ids``; no session id is kept). See ``app.repositories.events.erased_users``.
"""

from __future__ import annotations

import logging
import uuid
from collections import Counter
from collections.abc import Collection
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

import psycopg
from sqlalchemy.orm import Session

from app.core.locks import AdvisoryLock
from app.lifecycle.erasure import FlagOutcome, flag_subtrees
from app.repositories.events import fetch_value, raw_connection
from consumers.archive import archived_sessions, erase_archived
from consumers.deadletter import PRIVATE_DETAIL

log = logging.getLogger(__name__)

DELETE_DEAD_LETTERS = (
    "DELETE FROM dead_letter WHERE user_id = %(user_id)s "
    "OR (user_id IS NULL AND position(%(quoted)s::bytea in raw) > 0)"
)
"""A user's dead letters (see the module invariants); ``quoted`` is the user id as a JSON string's bytes."""


@dataclass
class ErasureOutcome:
    """What one erasure removed and flagged."""

    request_id: str
    user_id: str
    events_deleted: int = 0
    """rows deleted from ``event_log`` and from archived files (``archived_events_deleted`` of them)"""
    archived_events_deleted: int = 0
    trajectories_deleted: int = 0
    dead_letters_deleted: int = 0
    eval_tasks_deleted: int = 0
    """eval tasks mined from the erased sessions (``evals.mined``: they hold the session's request)"""
    trajectory_ids: list[uuid.UUID] = field(default_factory=list)
    checkpoints_flagged: list[str] = field(default_factory=list)
    """checkpoints trained on the erased sessions and their descendants."""
    rolled_back_to: str | None = None
    """the ancestor production was rolled back to, when production was flagged."""
    production_unresolved: list[str] = field(default_factory=list)
    """why a flagged production still serves (no ancestor could replace it); empty otherwise."""
    repeated: bool = False
    """this (user, request id) was applied before; it was applied again, up to its own time."""
    reused_by: list[str] = field(default_factory=list)
    """other users whose erasures used this request id before (applied all the same)."""


def erase_now(session: Session, user_id: str, request_id: str) -> ErasureOutcome:
    """An operator's erasure outside the stream (``flywheel erase``): everything of the user up to now.
    Takes the projection lock exclusively, so no ingest batch is half-way through the user's events.
    """
    conn = raw_connection(session)

    now = fetch_value(conn, "SELECT now(), pg_advisory_xact_lock(%s)", (AdvisoryLock.PROJECTION,))
    return erase_user(session, user_id, request_id, now)


def erase_user(session: Session, user_id: str, request_id: str, requested_at: datetime) -> ErasureOutcome:
    """Erase everything of ``user_id`` up to ``requested_at`` in the caller's transaction, whether or
    not this ``(user_id, request_id)`` was applied before (see the module invariants).

    Raises:
        psycopg.Error: database faults (the caller's transaction rolls back as a whole).
    """
    out = ErasureOutcome(request_id=request_id, user_id=user_id)
    conn = raw_connection(session)
    with conn.cursor() as cur:
        cur.execute("SELECT user_id FROM erasure_request WHERE request_id = %s ORDER BY user_id", (request_id,))
        earlier = [r[0] for r in cur.fetchall()]
        out.repeated = user_id in earlier
        others = [u for u in earlier if u != user_id]
        if others:
            out.reused_by = others
            log.warning(
                "erasure request id %r was used before for user(s) %s; erasing user %r under it too",
                request_id,
                ", ".join(map(repr, others)),
                user_id,
            )
        # The sessions the request covers: any with an event at or before it (a session wholly
        # after the request is new data; another partition may already have delivered it).
        cur.execute(
            "SELECT DISTINCT session_id FROM event_log WHERE user_id = %s AND occurred_at <= %s "
            "UNION SELECT session_id FROM trajectory WHERE user_id = %s "
            "AND coalesce(started_at, last_event_at) <= %s",
            (user_id, requested_at, user_id, requested_at),
        )
        sessions = sorted({r[0] for r in cur.fetchall()} | archived_sessions(conn, user_id, requested_at))
        events, out.trajectory_ids, out.eval_tasks_deleted = _delete_sessions(cur, sessions, user_id)
        out.archived_events_deleted = erase_archived(
            session, user_id, sessions, until=requested_at, request_id=request_id
        )
        out.events_deleted = sum(events.values()) + out.archived_events_deleted
        out.trajectories_deleted = len(out.trajectory_ids)
        # Dead letters are raw bytes: those that claim the user (dead_letter.user_id, indexed), and
        # among the unattributed ones (a partial index) any that carries the user id as a JSON string.
        cur.execute(DELETE_DEAD_LETTERS, {"user_id": user_id, "quoted": b'"' + user_id.encode() + b'"'})
        out.dead_letters_deleted = cur.rowcount
        flags = _flag_checkpoints(
            session, cur, out.trajectory_ids, user_id, actor="consumers:erasure", cause=f"erasure request {request_id}"
        )
        out.checkpoints_flagged = flags.flagged
        out.rolled_back_to = flags.rollback.checkpoint.id if flags.rollback else None
        out.production_unresolved = flags.unresolved
        cur.execute(
            "INSERT INTO erasure_request (request_id, user_id, events_deleted, trajectories_deleted, trajectory_ids, "
            "checkpoints_flagged, dead_letters_deleted, eval_tasks_deleted, requested_at) "
            "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s) "
            "ON CONFLICT (user_id, request_id) DO UPDATE SET "
            "events_deleted = erasure_request.events_deleted + EXCLUDED.events_deleted, "
            "trajectories_deleted = erasure_request.trajectories_deleted + EXCLUDED.trajectories_deleted, "
            "trajectory_ids = ARRAY(SELECT DISTINCT unnest(erasure_request.trajectory_ids || "
            "EXCLUDED.trajectory_ids) ORDER BY 1), "
            "checkpoints_flagged = ARRAY(SELECT DISTINCT unnest(erasure_request.checkpoints_flagged || "
            "EXCLUDED.checkpoints_flagged) ORDER BY 1), "
            "dead_letters_deleted = erasure_request.dead_letters_deleted + EXCLUDED.dead_letters_deleted, "
            "eval_tasks_deleted = erasure_request.eval_tasks_deleted + EXCLUDED.eval_tasks_deleted, "
            "requested_at = GREATEST(erasure_request.requested_at, EXCLUDED.requested_at)",
            (
                request_id,
                user_id,
                out.events_deleted,
                out.trajectories_deleted,
                out.trajectory_ids,
                out.checkpoints_flagged,
                out.dead_letters_deleted,
                out.eval_tasks_deleted,
                requested_at,
            ),
        )
    if out.repeated:
        log.info(
            "erasure request %r for user %r applied again, up to %s: %d events, %d trajectories, "
            "%d dead letters deleted",
            request_id,
            user_id,
            requested_at.isoformat(),
            out.events_deleted,
            out.trajectories_deleted,
            out.dead_letters_deleted,
        )
    return out


def purge_private_sessions(session: Session, session_ids: Collection[str]) -> dict[str, int]:
    """Delete what is stored of sessions just found to be privacy-mode sessions (privacy turned on
    part-way through: the events before the flag were stored as ordinary ones), in the caller's
    transaction: their ``event_log`` rows, trajectories (with segments, labels and the eval tasks
    mined from them), and flag every
    checkpoint that trained on one of those trajectories as an erasure does. Their dead letters
    (those whose bytes claim the session: ``dead_letter.session_id``) keep their place and reason
    but lose their key, bytes and headers (``redacted = 'privacy'``).

    Returns:
        ``{session_id: events deleted}`` for the sessions that had any.
    Raises:
        psycopg.Error: database faults (the caller's transaction rolls back as a whole).
    """
    if not session_ids:
        return {}
    with raw_connection(session).cursor() as cur:
        events, trajectories, _ = _delete_sessions(cur, sorted(session_ids))
        if trajectories:
            _flag_checkpoints(
                session, cur, trajectories, actor="consumers:privacy", cause="a privacy-mode session purged"
            )
        cur.execute(
            "UPDATE dead_letter SET key = NULL, raw = NULL, raw_sha256 = NULL, headers = NULL, redacted = 'privacy', "
            "detail = %s || detail WHERE session_id = ANY(%s) AND redacted IS NULL",
            (PRIVATE_DETAIL, sorted(session_ids)),
        )
    return dict(events)


def _delete_sessions(
    cur: psycopg.Cursor[Any], sessions: list[str], user_id: str | None = None
) -> tuple[Counter[str], list[uuid.UUID], int]:
    """Delete the ``event_log`` rows of ``sessions`` (the one DELETE the append-only trigger lets
    through: ``flywheel.erasure`` is on for it alone), their trajectories (cascading to segments
    and labels), only ``user_id``'s rows if given, and the eval tasks mined from those trajectories.

    Returns:
        (events deleted per session id, the deleted trajectories' ids, sorted, eval tasks deleted).
    """
    only = "" if user_id is None else " AND user_id = %(user_id)s"
    params = {"sessions": sessions, "user_id": user_id}
    cur.execute("SELECT set_config('flywheel.erasure', 'on', true)")
    cur.execute(f"DELETE FROM event_log WHERE session_id = ANY(%(sessions)s){only} RETURNING session_id", params)
    events = Counter(r[0] for r in cur.fetchall())
    cur.execute("SELECT set_config('flywheel.erasure', 'off', true)")
    cur.execute(f"DELETE FROM trajectory WHERE session_id = ANY(%(sessions)s){only} RETURNING id", params)
    trajectories = sorted(r[0] for r in cur.fetchall())
    cur.execute("DELETE FROM eval_task WHERE source_trajectory_id = ANY(%s)", (trajectories,))
    return events, trajectories, cur.rowcount


def _flag_checkpoints(
    session: Session,
    cur: psycopg.Cursor[Any],
    trajectory_ids: list[uuid.UUID],
    user_id: str | None = None,
    *,
    actor: str,
    cause: str,
) -> FlagOutcome:
    """Flag every checkpoint that trained on one of ``trajectory_ids`` or, if given, on any trajectory
    of ``user_id``, and their descendants; stop a flagged canary and move production off a flagged
    checkpoint (:func:`app.lifecycle.erasure.flag_subtrees`)."""
    cur.execute(
        "SELECT DISTINCT checkpoint_id FROM checkpoint_trajectory WHERE user_id = %s OR trajectory_id = ANY(%s)",
        (user_id, trajectory_ids),
    )
    return flag_subtrees(session, [r[0] for r in cur.fetchall()], actor=actor, cause=cause)


def list_erasures(session: Session, user_id: str | None = None, limit: int = 50) -> list[dict[str, Any]]:
    """Processed erasure requests, newest first (``user_id``: only that user's), as JSON-ready dicts:
    the request's key, when it was requested and applied, what it deleted and flagged, ``outcome``
    (``erased``: something was deleted; ``nothing_stored``: the user had nothing stored), and
    ``request_id_shared_with``: the other users whose requests carry the same request id."""
    where, params = ("WHERE e.user_id = %(user)s", {"user": user_id}) if user_id is not None else ("", {})
    with raw_connection(session).cursor() as cur:
        cur.execute(
            "SELECT e.request_id, e.user_id, e.requested_at, e.created_at, e.events_deleted, e.trajectories_deleted, "
            "e.dead_letters_deleted, e.eval_tasks_deleted, e.checkpoints_flagged, "
            "ARRAY(SELECT o.user_id FROM erasure_request o WHERE o.request_id = e.request_id "
            "AND o.user_id <> e.user_id ORDER BY o.user_id) "
            f"FROM erasure_request e {where} ORDER BY e.created_at DESC, e.id DESC LIMIT %(limit)s",
            {**params, "limit": limit},
        )
        rows = cur.fetchall()
    out = []
    for request_id, user, requested_at, applied_at, events, trajectories, dead, tasks, flagged, shared in rows:
        deleted = events + trajectories + dead + tasks
        out.append(
            {
                "request_id": request_id,
                "user_id": user,
                "requested_at": requested_at.isoformat() if requested_at else None,
                "applied_at": applied_at.isoformat(),
                "outcome": "erased" if deleted else "nothing_stored",
                "events_deleted": events,
                "trajectories_deleted": trajectories,
                "dead_letters_deleted": dead,
                "eval_tasks_deleted": tasks,
                "checkpoints_flagged": list(flagged),
                "request_id_shared_with": list(shared),
            }
        )
    return out

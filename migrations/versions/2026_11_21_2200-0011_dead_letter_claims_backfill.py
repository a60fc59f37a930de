"""dead_letter: attribute and redact the rows stored before migrations 0008 and 0010

Migrations 0008 (``user_id``) and 0010 (``session_id``, ``redacted``) added the columns the
consumer fills from what a dead letter's raw JSON claims, but left the rows already stored without
them. Those rows were found only by a scan of their bytes (an erasure) or not at all (a privacy
purge looks rows up by ``session_id``), and a malformed record of a privacy-mode session kept its
bytes. This migration reads each such row once and applies today's ingest rules to it
(``consumers.deadletter.claim_of``, restated here so the migration stays what it is when that
module changes):

- ``user_id`` / ``session_id``: the top-level string of a JSON object's key, 1 to 128 characters,
  no NUL, valid UTF-8; not looked for in an ``oversized`` record (the consumer never parses one);
- the row loses its key, bytes and headers (``redacted = 'privacy'``, ``detail`` prefixed as
  ``consumers.deadletter.PRIVATE_DETAIL``) when its bytes ask for ``privacy_mode`` (any value but
  absent, ``null``, ``false`` or ``0``) or its session has a ``privacy_tombstone``.

Rows are read in ``id`` order, 1,000 at a time. Downgrade keeps the values (0010's downgrade drops
the columns).

Revision ID: 0011
Revises: 0010
Create Date: 2026-11-21 22:00:00
"""
import json
from typing import Any, Sequence, Union

import sqlalchemy as sa
from alembic import op

revision: str = '0011'
down_revision: Union[str, None] = '0010'
branch_labels: Union[str, Sequence[str], None] = None
depends_on: Union[str, Sequence[str], None] = None

PRIVATE_DETAIL = "raw bytes not kept: the session is in privacy mode; "
MAX_ID_CHARS = 128
PAGE = 1000


def _claimed(obj: dict[str, Any], key: str) -> str | None:
    v = obj.get(key)
    if not isinstance(v, str) or not 0 < len(v) <= MAX_ID_CHARS or "\x00" in v:
        return None
    try:
        v.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate escape
        return None
    return v


def claims(raw: bytes | None) -> tuple[str | None, str | None, bool]:
    """(user_id, session_id, asks for privacy_mode) of a dead letter's raw bytes; never raises."""
    try:
        obj = json.loads(raw.decode("utf-8")) if raw else None
    except (ValueError, RecursionError):  # not UTF-8, not JSON, nested too deep
        return None, None, False
    if not isinstance(obj, dict):
        return None, None, False
    return _claimed(obj, "user_id"), _claimed(obj, "session_id"), obj.get("privacy_mode") not in (None, False, 0)


def upgrade() -> None:
    conn = op.get_bind()
    private = {r[0] for r in conn.execute(sa.text("SELECT session_id FROM privacy_tombstone"))}
    last = 0
    while True:
        rows = conn.execute(sa.text(
            "SELECT id, raw, user_id, session_id FROM dead_letter WHERE id > :last AND raw IS NOT NULL "
            "AND redacted IS NULL AND reason <> 'oversized' AND (user_id IS NULL OR session_id IS NULL) "
            "ORDER BY id LIMIT :page"), {"last": last, "page": PAGE}).fetchall()
        if not rows:
            return
        last = rows[-1][0]
        for row_id, raw, stored_user, stored_session in rows:
            claimed_user, claimed_session, asks_privacy = claims(raw)
            user_id, session_id = stored_user or claimed_user, stored_session or claimed_session
            if asks_privacy or (session_id is not None and session_id in private):
                conn.execute(sa.text(
                    "UPDATE dead_letter SET user_id = :u, session_id = :s, key = NULL, raw = NULL, headers = NULL, "
                    "redacted = 'privacy', detail = :prefix || detail WHERE id = :id"),
                    {"u": user_id, "s": session_id, "prefix": PRIVATE_DETAIL, "id": row_id})
            elif (user_id, session_id) != (stored_user, stored_session):  # a row with nothing new is not rewritten
                conn.execute(sa.text("UPDATE dead_letter SET user_id = :u, session_id = :s WHERE id = :id"),
                             {"u": user_id, "s": session_id, "id": row_id})


def downgrade() -> None:
    pass

"""API bearer tokens: creation, revocation, authentication and the role -> permission map.

Invariant: the plaintext token exists only in the return value of :func:`create_token` (printed
once by ``flywheel tokens create``); the database holds its sha256. A revoked token never
authenticates again. Roles:

- ``viewer``: read everything (checkpoints, eval reports, production, audit log).
- ``release_manager``: viewer + promote, roll back and reject (the people who decide what serves),
  and override a gate that ended ``insufficient_evidence`` with a written reason.
- ``service``: viewer + reject. Automation (eval scheduler, erasure job, CI) may take a candidate
  out of the running, but moving production is a human decision, so ``service`` cannot promote or
  roll back.
- ``inference``: calls the serving front (``infer``) and nothing else: the key the product backend
  holds (``serving.front_keys``); it reads no API route.
"""

from __future__ import annotations

import hashlib
import secrets
import uuid
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Literal

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from app.core.errors import ConflictError, FlywheelError, NotFoundError
from app.models import ApiToken
from app.models.promotion import ROLES
from app.repositories.audit import record_audit

Role = Literal["viewer", "release_manager", "service", "inference"]
Permission = Literal["read", "reject", "promote", "override", "infer"]

#: What each role may do. ``promote`` covers promotions and rollbacks; ``override`` promoting over a
#: gate that found insufficient evidence (with ``promote``, and a written reason).
PERMISSIONS: dict[str, frozenset[str]] = {
    "viewer": frozenset({"read"}),
    "release_manager": frozenset({"read", "reject", "promote", "override"}),
    "service": frozenset({"read", "reject"}),
    "inference": frozenset({"infer"}),
}

TOKEN_PREFIX = "fw_"


class InvalidTokenRequest(FlywheelError):
    """A token operation with bad arguments (unknown role, empty name)."""

    status_code = 422


@dataclass(frozen=True)
class Principal:
    """The authenticated caller: the token's name is the actor recorded in the audit log."""

    token_id: uuid.UUID
    name: str
    role: str

    def can(self, permission: str) -> bool:
        """Whether this principal's role grants ``permission``."""
        return permission in PERMISSIONS.get(self.role, frozenset())


def hash_token(raw: str) -> str:
    """Hex sha256 of a plaintext token (what ``api_token.token_hash`` stores)."""
    return hashlib.sha256(raw.encode("utf-8")).hexdigest()


def create_token(session: Session, *, name: str, role: str, actor: str) -> tuple[ApiToken, str]:
    """Create a token and flush. Returns the row and the plaintext token (shown once, never stored).

    The token is ``fw_`` + 32 random bytes, url-safe base64 (256 bits of entropy).

    Raises:
        InvalidTokenRequest: unknown role or empty name.
        ConflictError: a live token with this name exists (revoke it first).
    """
    name = name.strip()
    if role not in ROLES:
        raise InvalidTokenRequest(f"unknown role {role!r}", reasons=[f"roles: {', '.join(ROLES)}"])
    if not name or len(name) > 128:
        raise InvalidTokenRequest("token name must be 1-128 characters")
    if session.scalar(select(ApiToken.id).where(ApiToken.name == name, ApiToken.revoked_at.is_(None))):
        raise ConflictError(f"a live token named {name!r} exists", reasons=["revoke it first or pick another name"])
    raw = TOKEN_PREFIX + secrets.token_urlsafe(32)
    row = ApiToken(id=uuid.uuid4(), name=name, role=role, token_hash=hash_token(raw))
    session.add(row)
    try:
        with session.begin_nested():
            session.flush()
    except IntegrityError:  # a concurrent create with the same name won the partial unique index
        raise ConflictError(f"a live token named {name!r} exists") from None
    record_audit(
        session,
        actor=actor,
        action="token.created",
        target=f"token:{name}",
        details={"token_id": str(row.id), "role": role},
    )
    return row, raw


def revoke_token(session: Session, name_or_id: str, *, actor: str) -> ApiToken:
    """Revoke the live token with this name or id and flush.

    Raises:
        NotFoundError: no live token matches.
    """
    stmt = select(ApiToken).where(ApiToken.revoked_at.is_(None))
    try:
        stmt = stmt.where(ApiToken.id == uuid.UUID(name_or_id))
    except ValueError:
        stmt = stmt.where(ApiToken.name == name_or_id)
    row = session.scalars(stmt.with_for_update()).one_or_none()
    if row is None:
        raise NotFoundError(f"no live token {name_or_id!r}")
    row.revoked_at = datetime.now(UTC)
    session.flush()
    record_audit(
        session,
        actor=actor,
        action="token.revoked",
        target=f"token:{row.name}",
        details={"token_id": str(row.id), "role": row.role},
    )
    return row


def list_tokens(session: Session, *, include_revoked: bool = False) -> list[ApiToken]:
    """Tokens, oldest first (hashes included; never the plaintext)."""
    stmt = select(ApiToken).order_by(ApiToken.created_at, ApiToken.name)
    if not include_revoked:
        stmt = stmt.where(ApiToken.revoked_at.is_(None))
    return list(session.scalars(stmt))


def authenticate(session: Session, raw: str) -> Principal | None:
    """The principal of a live token, or None for an unknown or revoked one.

    The lookup is by the sha256 of the presented token (a unique index), so comparing in constant
    time is unnecessary: an attacker learns nothing from timing a hash lookup.
    """
    row = session.execute(
        select(ApiToken.id, ApiToken.name, ApiToken.role).where(
            ApiToken.token_hash == hash_token(raw), ApiToken.revoked_at.is_(None)
        )
    ).one_or_none()
    return Principal(token_id=row.id, name=row.name, role=row.role) if row else None

"""FastAPI dependencies: the request's database session and the caller's identity and role.

Invariant: a request uses one session (FastAPI caches the dependency per request); read endpoints
never commit, write endpoints commit once after the service function succeeded, and any exception
rolls the session back before it is closed.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Annotated

from fastapi import Depends
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.core.db import get_sessionmaker
from app.core.errors import AuthError, ForbiddenError
from app.promotion.tokens import Principal, authenticate

bearer_scheme = HTTPBearer(auto_error=False, scheme_name="bearer",
                           description="an API token from `flywheel tokens create --role ROLE --name NAME`")


def get_session() -> Iterator[Session]:
    """One SQLAlchemy session per request; rolled back on error, closed at the end."""
    with get_sessionmaker()() as session:
        try:
            yield session
        except BaseException:
            session.rollback()
            raise


SessionDep = Annotated[Session, Depends(get_session)]


def get_principal(session: SessionDep,
                  credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]) -> Principal:
    """The caller behind the ``Authorization: Bearer <token>`` header.

    Raises:
        AuthError: no bearer token, or an unknown or revoked one (401).
    """
    if credentials is None or not credentials.credentials:
        raise AuthError("missing bearer token", reasons=["send 'Authorization: Bearer <token>'"])
    principal = authenticate(session, credentials.credentials)
    if principal is None:
        raise AuthError("invalid or revoked token")
    return principal


def require(permission: str):
    """A dependency that admits only principals whose role grants ``permission`` (else 403)."""

    def dependency(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if not principal.can(permission):
            raise ForbiddenError(f"role {principal.role!r} may not {permission}",
                                 reasons=[f"token {principal.name!r} has role {principal.role!r}"])
        return principal

    dependency.__name__ = f"require_{permission}"
    return dependency


PrincipalDep = Annotated[Principal, Depends(get_principal)]
#: Any valid token (viewer, release_manager, service).
ViewerDep = Annotated[Principal, Depends(require("read"))]
#: release_manager or service: may reject a candidate.
RejecterDep = Annotated[Principal, Depends(require("reject"))]
#: release_manager: may promote and roll back; its token name is the actor recorded.
ActorDep = Annotated[Principal, Depends(require("promote"))]

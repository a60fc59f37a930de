"""FastAPI dependencies: the request's database session and the caller's identity and role.

Invariant: a request uses one session (FastAPI caches the dependency per request); read endpoints
never commit, write endpoints commit once after the service function succeeded, and any exception
rolls the session back before it is closed. On a route with a body, the caller's token and role are
checked before the body is parsed (:class:`RoleFirstRoute`): a viewer's malformed POST is a 403,
not a 422.
"""

from __future__ import annotations

from collections.abc import Callable, Coroutine, Iterator
from typing import Annotated, Any

from fastapi import Depends, Request, Response
from fastapi.concurrency import run_in_threadpool
from fastapi.dependencies.models import Dependant
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from app.core.db import get_sessionmaker
from app.core.errors import AuthError, ForbiddenError
from app.repositories.tokens import Principal, authenticate

bearer_scheme = HTTPBearer(
    auto_error=False,
    scheme_name="bearer",
    description="an API token from `flywheel tokens create --role ROLE --name NAME`",
)


def get_session() -> Iterator[Session]:
    """One SQLAlchemy session per request; rolled back on error, closed at the end."""
    with get_sessionmaker()() as session:
        try:
            yield session
        except BaseException:
            session.rollback()
            raise


SessionDep = Annotated[Session, Depends(get_session)]


def get_principal(
    session: SessionDep, credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(bearer_scheme)]
) -> Principal:
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


def require(permission: str) -> Callable[[Principal], Principal]:
    """A dependency that admits only principals whose role grants ``permission`` (else 403)."""

    def dependency(principal: Annotated[Principal, Depends(get_principal)]) -> Principal:
        if not principal.can(permission):
            raise ForbiddenError(
                f"role {principal.role!r} may not {permission}",
                reasons=[f"token {principal.name!r} has role {principal.role!r}"],
            )
        return principal

    dependency.__name__ = f"require_{permission}"
    dependency.permission = permission  # type: ignore[attr-defined]  # read by RoleFirstRoute
    return dependency


def _required_permission(dependant: Dependant) -> str | None:
    """The permission a :func:`require` dependency of ``dependant`` (at any depth) asks for, or None."""
    for dep in dependant.dependencies:
        found = getattr(dep.call, "permission", None) or _required_permission(dep)
        if found:
            return found
    return None


def _check_role(request: Request, permission: str) -> None:
    """:func:`get_principal` and :func:`require` on the request's headers alone, in a session of
    its own (the route's dependencies run again after; this is a read).

    Raises:
        AuthError: no bearer token, or an unknown or revoked one (401).
        ForbiddenError: the token's role lacks ``permission`` (403).
    """
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    credentials = (
        HTTPAuthorizationCredentials(scheme=scheme, credentials=token.strip()) if scheme.lower() == "bearer" else None
    )
    with get_sessionmaker()() as session:
        principal = get_principal(session, credentials)
    require(permission)(principal)


class RoleFirstRoute(APIRoute):
    """An ``APIRoute`` that, when it takes a body and requires a permission (:func:`require`),
    authenticates the caller and checks the role before FastAPI reads and validates the body."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()
        permission = _required_permission(self.dependant)
        if self.body_field is None or permission is None:
            return handler

        async def role_first(request: Request) -> Response:
            await run_in_threadpool(_check_role, request, permission)
            return await handler(request)

        return role_first


PrincipalDep = Annotated[Principal, Depends(get_principal)]
#: Any valid token (viewer, release_manager, service).
ViewerDep = Annotated[Principal, Depends(require("read"))]
#: release_manager or service: may reject a candidate.
RejecterDep = Annotated[Principal, Depends(require("reject"))]
#: release_manager: may promote and roll back; its token name is the actor recorded.
ActorDep = Annotated[Principal, Depends(require("promote"))]

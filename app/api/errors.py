"""Error responses, mapped once: every error answer is ``{"error": {"code", "message", "reasons"}}``.

Domain errors (``app.core.errors.FlywheelError`` subclasses) carry their HTTP status; request
validation errors become 422 with one reason per invalid field; a database that does not answer
(connection refused or lost, pool exhausted) is a 503 with ``Retry-After``; anything else is a 500
whose details go to the log, never to the client.
"""

from __future__ import annotations

import logging
from typing import Any

import psycopg
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from sqlalchemy import exc as sa_exc
from starlette.exceptions import HTTPException as StarletteHTTPException

from app.api.schemas import ErrorBody
from app.core.db import schema_missing_reason, unreachable_reason
from app.core.errors import AuthError, ConflictError, FlywheelError, ForbiddenError, InfrastructureError, NotFoundError

log = logging.getLogger("flywheel.api")

_CODES: tuple[tuple[type[FlywheelError], str], ...] = (
    (AuthError, "unauthorized"),
    (ForbiddenError, "forbidden"),
    (NotFoundError, "not_found"),
    (ConflictError, "conflict"),
    (InfrastructureError, "unavailable"),
)
_STATUS_CODES = {
    400: "bad_request",
    401: "unauthorized",
    403: "forbidden",
    404: "not_found",
    405: "method_not_allowed",
    406: "not_acceptable",
    409: "conflict",
    413: "too_large",
    415: "unsupported_media_type",
    422: "invalid_request",
    503: "unavailable",
}


def model_response(model: BaseModel, status_code: int = 200) -> Response:
    """A JSON response serialised straight from a pydantic model (Rust serializer), skipping
    FastAPI's dump-then-revalidate of the return value; the route keeps ``response_model`` for the
    OpenAPI schema. Used on the hot read paths (lists, production)."""
    return Response(model.model_dump_json(), status_code=status_code, media_type="application/json")


def error_response(
    status: int, code: str, message: str, reasons: list[str] | None = None, headers: dict[str, str] | None = None
) -> JSONResponse:
    """A JSON error answer in the API's one error shape."""
    body = ErrorBody.model_validate({"error": {"code": code, "message": message, "reasons": reasons or []}})
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def _code_for(exc: FlywheelError) -> str:
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return _STATUS_CODES.get(exc.status_code, "internal_error" if exc.status_code >= 500 else "error")


async def _flywheel_error(request: Request, exc: FlywheelError) -> JSONResponse:
    if exc.status_code >= 500:
        log.error("request %s %s failed: %s", request.method, request.url.path, exc, exc_info=exc)
    headers = {"WWW-Authenticate": "Bearer"} if isinstance(exc, AuthError) else None
    return error_response(exc.status_code, _code_for(exc), exc.message, [str(r) for r in exc.reasons], headers)


async def _validation_error(request: Request, exc: RequestValidationError) -> JSONResponse:
    reasons = [f"{'.'.join(str(p) for p in err.get('loc', ()))}: {err.get('msg', '')}" for err in exc.errors()]
    return error_response(422, "invalid_request", "the request is invalid", reasons)


async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    return error_response(
        exc.status_code,
        _STATUS_CODES.get(exc.status_code, "error"),
        str(exc.detail),
        headers=getattr(exc, "headers", None),
    )


DATABASE_RETRY_AFTER_S = 5
"""``Retry-After`` (seconds) of the 503 answered while the database does not answer."""


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    reason = unreachable_reason(exc)
    if reason is None:
        return await _schema_error(request, exc)
    log.warning("database unavailable on %s %s: %s", request.method, request.url.path, reason)
    return error_response(
        503,
        "unavailable",
        "the database is unavailable; retry shortly",
        headers={"Retry-After": str(DATABASE_RETRY_AFTER_S)},
    )


async def _schema_error(request: Request, exc: Exception) -> JSONResponse:
    reason = schema_missing_reason(exc)
    if reason is None:  # a statement's error: ours
        return await _unhandled(request, exc)
    log.error(
        "the database lacks this release's schema on %s %s: %s; run `flywheel db upgrade`",
        request.method,
        request.url.path,
        reason,
    )
    return error_response(503, "unavailable", "the database is not migrated to this release's schema")


async def _unhandled(request: Request, exc: Exception) -> JSONResponse:
    log.error("unhandled error on %s %s", request.method, request.url.path, exc_info=exc)
    return error_response(500, "internal_error", "internal server error")


def install_error_handlers(app: FastAPI) -> None:
    """Register the handlers above on ``app`` (once, in the app factory)."""
    # Starlette types a handler as taking any Exception; each of ours takes the class it is registered for.
    app.add_exception_handler(FlywheelError, _flywheel_error)  # type: ignore[arg-type]
    app.add_exception_handler(RequestValidationError, _validation_error)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error)  # type: ignore[arg-type]

    # connection refused or lost, pool timeout -> 503; a statement's error stays a 500
    for db_error in (
        sa_exc.OperationalError,
        sa_exc.InterfaceError,
        sa_exc.TimeoutError,
        psycopg.OperationalError,
        psycopg.InterfaceError,
    ):
        app.add_exception_handler(db_error, _database_error)
    # a table or column the database lacks (not migrated to this release) -> 503 naming it; others 500
    for schema_error in (sa_exc.ProgrammingError, psycopg.ProgrammingError):
        app.add_exception_handler(schema_error, _schema_error)
    app.add_exception_handler(Exception, _unhandled)


#: OpenAPI ``responses=`` entries for the error answers of authenticated routes.
AUTH_RESPONSES: dict[int | str, dict[str, Any]] = {
    401: {"model": ErrorBody, "description": "missing, unknown or revoked token"},
    403: {"model": ErrorBody, "description": "the token's role lacks the permission"},
    422: {"model": ErrorBody, "description": "invalid request"},
}
NOT_FOUND: dict[int | str, dict[str, Any]] = {404: {"model": ErrorBody, "description": "no such entity"}}
CONFLICT: dict[int | str, dict[str, Any]] = {
    409: {"model": ErrorBody, "description": "refused, with every reason"},
    400: {"model": ErrorBody, "description": "the body is not JSON"},
}

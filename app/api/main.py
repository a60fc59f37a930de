"""The promotion API's app factory (``flywheel api`` serves ``create_app()`` with uvicorn).

Invariant: error shapes are mapped once here (``app.api.errors``); every route except ``/``,
``/healthz``, ``/readyz``, ``/metrics`` and the API docs requires a bearer token, checked before a request body is parsed
(``app.api.deps.RoleFirstRoute``); a body past ``FLYWHEEL_API_MAX_BODY_BYTES`` is answered 413
unread (``app.api.limits``); all resources live under ``/v1``. ``/docs`` (Swagger UI) and ``/redoc``
load their scripts and styles from this server (``/static-offline-docs``, the assets of the
``fastapi-offline`` package), never from a CDN, so they work on a host without internet.
``/metrics`` is this process's metrics in the Prometheus text format (``app.core.metrics``).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import APIRouter, FastAPI, Response
from fastapi_offline import FastAPIOffline

from app.api.errors import install_error_handlers
from app.api.limits import BodySizeLimit
from app.api.routers import ab_comparisons, audit, canaries, checkpoints, dashboard, health, promotions
from app.core.db import get_engine
from app.core.errors import ConfigurationError
from app.core.metrics import render_metrics
from app.core.settings import get_settings
from app.core.telemetry import configure_telemetry

DESCRIPTION = """\
The release manager's API: read checkpoints and their gate reports, promote a gate-passed
checkpoint, roll back, reject, start and stop a canary and read its online signals, read the
append-only audit log, read the A/B results of checkpoints on fresh traffic.

Authenticate with `Authorization: Bearer <token>` (`flywheel tokens create --role ROLE --name NAME`).
Roles: `viewer` reads; `service` reads and rejects; `release_manager` reads, rejects, promotes,
rolls back and starts or stops canaries. Errors are `{"error": {"code", "message", "reasons"}}`.
"""


@asynccontextmanager
async def lifespan(app: FastAPI) -> AsyncIterator[None]:
    """Telemetry once per process; dispose the database pool at shutdown."""
    configure_telemetry("flywheel-api")
    yield

    try:
        get_engine().dispose()
    except ConfigurationError:  # never configured: nothing to dispose
        pass


def create_app() -> FastAPI:
    """A new FastAPI app (routers under ``/v1``, dashboard at ``/``, health at the root, API docs at
    ``/docs`` and ``/redoc`` served with their assets)."""
    app = FastAPIOffline(title="flywheel promotion API", version="1", description=DESCRIPTION, lifespan=lifespan)
    install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=get_settings().api.max_body_bytes)
    v1 = APIRouter(prefix="/v1")
    v1.include_router(checkpoints.router)
    v1.include_router(promotions.router)
    v1.include_router(canaries.router)
    v1.include_router(audit.router)
    v1.include_router(ab_comparisons.router)
    app.include_router(v1)
    app.include_router(health.router)
    app.include_router(dashboard.router)
    app.add_api_route("/metrics", metrics, methods=["GET"], include_in_schema=False)
    return app


def metrics() -> Response:
    """This process's metrics for a Prometheus scrape (no token: scrapers hold none; the series
    carry counts and durations, no user data)."""
    body, content_type = render_metrics()
    return Response(body, media_type=content_type)

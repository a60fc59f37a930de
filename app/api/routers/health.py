"""``/healthz`` (the process answers) and ``/readyz`` (database reachable and migrated, broker reachable)."""

from __future__ import annotations

from fastapi import APIRouter
from fastapi.responses import JSONResponse
from sqlalchemy import text

from app.api.errors import error_response
from app.api.schemas import ErrorBody, Health, Readiness
from app.core.db import get_engine
from app.core.migrate import schema_behind
from app.core.net import broker_healthy, port_open
from app.core.settings import get_settings

router = APIRouter(tags=["health"])


@router.get("/healthz", response_model=Health, summary="Liveness")
def healthz() -> Health:
    """Always ``ok`` while the process serves requests (no dependency is checked)."""
    return Health(status="ok")


def _check_database() -> str | None:
    try:
        with get_engine().connect() as conn:
            conn.execute(text("SELECT 1"))
            behind = schema_behind(conn)
        return None if behind is None else f"database: {behind}: run `flywheel db upgrade`"
    except Exception as exc:  # any failure means "not ready"; the reason is reported
        return f"database: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"


def _check_broker() -> str | None:
    bootstrap = get_settings().kafka.bootstrap
    if not bootstrap:
        return "broker: FLYWHEEL_KAFKA_BOOTSTRAP is not configured"
    # A TCP probe first: kafka-python's client waits ~30 s for a dead bootstrap, a probe must not.
    hosts = [h.strip().rsplit(":", 1) for h in bootstrap.split(",") if h.strip()]
    if not any(len(h) == 2 and h[1].isdigit() and port_open(h[0].strip("[]"), int(h[1]), timeout=1.0) for h in hosts):
        return f"broker: {bootstrap} does not answer"
    return None if broker_healthy(bootstrap, timeout_s=2.0) else f"broker: {bootstrap} does not answer"


@router.get(
    "/readyz",
    response_model=Readiness,
    summary="Readiness",
    responses={503: {"model": ErrorBody, "description": "a dependency is unreachable"}},
)
def readyz() -> Readiness | JSONResponse:
    """``ready`` when the database answers ``SELECT 1`` and has this release's schema (not behind
    its migration head) and the broker answers a metadata request; else 503 with the failing checks
    as reasons."""
    failures = [f for f in (_check_database(), _check_broker()) if f]
    if failures:
        return error_response(503, "unavailable", "not ready", failures)
    return Readiness(status="ready", checks={"database": "ok", "broker": "ok"})

"""``/v1/audit`` (the append-only log), ``/v1/me`` and ``/v1/reports/{id}/report.png``."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Annotated

from fastapi import APIRouter, Query, Response
from fastapi.responses import FileResponse

from app.api.deps import PrincipalDep, SessionDep, ViewerDep
from app.api.errors import AUTH_RESPONSES, NOT_FOUND, model_response
from app.api.schemas import AuditEntry, Me, Page
from app.core.errors import NotFoundError
from app.core.settings import get_settings
from app.promotion import queries
from app.repositories.audit import list_audit
from app.repositories.tokens import PERMISSIONS

router = APIRouter(tags=["audit"], responses=AUTH_RESPONSES)


@router.get("/audit", response_model=Page[AuditEntry], summary="The audit log, newest first")
def audit(
    session: SessionDep,
    _: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 100,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    action: Annotated[
        str | None, Query(max_length=64, pattern=r"^[a-z_.]+$", description="e.g. checkpoint.promoted")
    ] = None,
) -> Response:
    """Every change with its actor, newest first. The database refuses UPDATE and DELETE on it."""
    before = None
    if cursor:
        before = queries.decode_id_cursor(cursor)
    rows = list_audit(session, limit=limit + 1, before_id=before, action=action)
    nxt = queries.encode_cursor([rows[limit - 1].id]) if len(rows) > limit else None
    return model_response(Page[AuditEntry](items=[AuditEntry.model_validate(r) for r in rows[:limit]], next_cursor=nxt))


@router.get("/me", response_model=Me, summary="Who the token belongs to")
def me(principal: PrincipalDep) -> Me:
    """The token's name (the actor recorded for its writes), role and permissions."""
    return Me(name=principal.name, role=principal.role, permissions=sorted(PERMISSIONS.get(principal.role, ())))


def _allowed(path: Path) -> bool:
    store = get_settings().store
    roots = [store.reports(), store.checkpoints()]
    return any(path.is_relative_to(root) for root in roots)


@router.get(
    "/reports/{decision_id}/report.png",
    response_class=FileResponse,
    responses={**NOT_FOUND, 200: {"content": {"image/png": {}}, "description": "the gate report figure"}},
    summary="The gate report PNG of a decision",
)
def report_png(decision_id: uuid.UUID, session: SessionDep, _: ViewerDep) -> FileResponse:
    """The figure the evals wrote for a gate decision (only files under the report or checkpoint
    directories are served)."""
    gate = queries.gate_decision(session, decision_id)
    if gate is None or not gate.report_path:
        raise NotFoundError(f"no report for gate decision {decision_id}")
    path = Path(gate.report_path)
    if not path.is_absolute():
        path = get_settings().store.reports() / path
    path = path.resolve()
    if not _allowed(path) or not path.is_file():
        raise NotFoundError(f"report of gate decision {decision_id} is not available")
    return FileResponse(path, media_type="image/png")

"""``/v1/canaries``: start, stop and read the canary (a gated candidate served to a sticky
fraction of users beside production)."""

from __future__ import annotations

import uuid
from typing import Annotated

from fastapi import APIRouter, Path, Response, status
from sqlalchemy.orm import Session

from app.api.deps import ActorDep, RoleFirstRoute, SessionDep, ViewerDep
from app.api.errors import AUTH_RESPONSES, CONFLICT, NOT_FOUND, model_response
from app.api.online_schemas import CanaryOut, CanaryRequest, CanaryStatusOut, CanaryStopRequest
from app.lifecycle.canary import get_active_canary, get_canary, list_canaries, start_canary, stop_canary
from app.models import Canary
from app.promotion.canary_policy import ready_times


def canary_views(session: Session, rows: list[Canary]) -> list[CanaryOut]:
    """``rows`` as the API shows them, each with when the canary policy marked it ready."""
    ready = ready_times(session, [r.id for r in rows])
    out = [CanaryOut.model_validate(r) for r in rows]
    for view in out:
        view.ready_at = ready.get(str(view.id))
    return out


router = APIRouter(prefix="/canaries", tags=["canaries"], responses=AUTH_RESPONSES, route_class=RoleFirstRoute)
CanaryPath = Annotated[uuid.UUID, Path(description="canary id")]


@router.get("", response_model=CanaryStatusOut, summary="The active canary and the recent ones")
def canary_status(session: SessionDep, _: ViewerDep) -> Response:
    """The active canary (null when none) and the 20 most recent canaries, newest first."""
    active = get_active_canary(session)
    return model_response(
        CanaryStatusOut(
            active=canary_views(session, [active])[0] if active else None,
            recent=canary_views(session, list_canaries(session, limit=20)),
        )
    )


@router.get("/{canary_id}", response_model=CanaryOut, responses=NOT_FOUND, summary="One canary")
def canary_detail(canary_id: CanaryPath, session: SessionDep, _: ViewerDep) -> CanaryOut:
    """A canary by id."""
    return canary_views(session, [get_canary(session, canary_id)])[0]


@router.post(
    "",
    response_model=CanaryOut,
    status_code=status.HTTP_201_CREATED,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Start a canary of a gate-passed checkpoint (release_manager)",
)
def create_canary(body: CanaryRequest, session: SessionDep, principal: ActorDep, response: Response) -> CanaryOut:
    """Serve ``checkpoint_id`` to ``fraction`` of users (sticky: ``sha256(canary_id, user_id)``
    below the fraction). Refused with 409 and every reason when a canary is already active, the
    checkpoint's gate has not passed against the current production, or it is not STABLE. One
    transaction holds the canary row, the audit entry and the ``canary.started`` outbox message."""
    canary = start_canary(
        session, checkpoint_id=body.checkpoint_id, fraction=body.fraction, actor=principal.name, reason=body.reason
    )
    session.commit()
    response.headers["Location"] = f"/v1/canaries/{canary.id}"
    return CanaryOut.model_validate(canary)


@router.delete(
    "",
    response_model=CanaryOut,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Stop the active canary (release_manager)",
)
def delete_active_canary(body: CanaryStopRequest, session: SessionDep, principal: ActorDep) -> CanaryOut:
    """Stop the active canary (404 when none): every user is served by production again;
    audited and announced as ``canary.stopped``."""
    canary = stop_canary(session, actor=principal.name, reason=body.reason)
    session.commit()
    return CanaryOut.model_validate(canary)


@router.delete(
    "/{canary_id}",
    response_model=CanaryOut,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Stop a canary (release_manager)",
)
def delete_canary(
    canary_id: CanaryPath, body: CanaryStopRequest, session: SessionDep, principal: ActorDep
) -> CanaryOut:
    """Stop the named canary (409 when it is already stopped)."""
    canary = stop_canary(session, actor=principal.name, reason=body.reason, canary_id=canary_id)
    session.commit()
    return CanaryOut.model_validate(canary)

"""``/v1/promotions``, ``/v1/rollbacks``, ``/v1/production``: moving and reading production."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated

from fastapi import APIRouter, Query, Response, status
from sqlalchemy import select
from sqlalchemy.orm import Session

from app.api.deps import ActorDep, RoleFirstRoute, SessionDep, ViewerDep
from app.api.errors import AUTH_RESPONSES, CONFLICT, NOT_FOUND, model_response
from app.api.routers.checkpoints import checkpoint_summaries
from app.api.schemas import Page, ProductionOut, PromotionOut, PromotionRequest, RollbackRequest
from app.core.errors import ForbiddenError
from app.core.net import served_weight_version
from app.core.settings import get_settings
from app.lifecycle.serving_state import read_serving_state
from app.models import Promotion
from app.promotion import queries
from app.promotion.service import ProductionChange, promote_checkpoint, rollback_production
from app.repositories.checkpoints import get_production

router = APIRouter(tags=["promotions"], responses=AUTH_RESPONSES, route_class=RoleFirstRoute)


def _committed(session: Session, response: Response, change: ProductionChange) -> PromotionOut:
    """Commit a production change (the request is its transaction boundary) and answer it: the
    promotion row, with ``Location`` pointing at ``/v1/production``."""
    session.commit()
    response.headers["Location"] = "/v1/production"
    return PromotionOut.model_validate(change.promotion)


@router.get("/promotions", response_model=Page[PromotionOut], summary="Production changes, newest first")
def list_promotions(
    session: SessionDep,
    _: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
) -> Response:
    """Every promotion and rollback, newest first."""
    rows, nxt = queries.list_promotions(session, limit=limit, before=cursor)
    return model_response(Page[PromotionOut](items=[PromotionOut.model_validate(r) for r in rows], next_cursor=nxt))


@router.post(
    "/promotions",
    response_model=PromotionOut,
    status_code=status.HTTP_201_CREATED,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Promote a gate-passed checkpoint (release_manager)",
)
def create_promotion(
    body: PromotionRequest, session: SessionDep, principal: ActorDep, response: Response
) -> PromotionOut:
    """Make ``checkpoint_id`` production. Refused with 409 and every reason when its gate has not
    passed (missing, failed, insufficient evidence without ``override_reason``, or compared against
    another production), it is not STABLE, or ``expected_production_id`` is not the current
    production. ``override_reason`` promotes over a gate that ended ``insufficient_evidence``: it
    needs the ``override`` permission (403) and written text (422), and is audited as
    ``gate.overridden``. On success, one transaction holds the promotion row, the status changes, the
    audit entries and the ``checkpoint.promoted`` outbox message."""
    if body.override_reason is not None and not principal.can("override"):
        raise ForbiddenError(
            f"role {principal.role!r} may not override the gate",
            reasons=[f"token {principal.name!r} has role {principal.role!r}"],
        )
    change = promote_checkpoint(
        session,
        checkpoint_id=body.checkpoint_id,
        expected_production_id=body.expected_production_id,
        actor=principal.name,
        reason=body.reason,
        override_reason=body.override_reason,
    )
    return _committed(session, response, change)


@router.post(
    "/rollbacks",
    response_model=PromotionOut,
    status_code=status.HTTP_201_CREATED,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Roll production back (release_manager)",
)
def create_rollback(
    body: RollbackRequest, session: SessionDep, principal: ActorDep, response: Response
) -> PromotionOut:
    """Return production to the previous production checkpoint, or to ``checkpoint_id`` if it was
    production before. Same transaction shape as a promotion; announced as ``checkpoint.rolled_back``."""
    change = rollback_production(
        session,
        expected_production_id=body.expected_production_id,
        actor=principal.name,
        reason=body.reason,
        checkpoint_id=body.checkpoint_id,
    )
    return _committed(session, response, change)


@router.get("/production", response_model=ProductionOut, summary="The production checkpoint and what serves")
def production(session: SessionDep, _: ViewerDep) -> Response:
    """The production checkpoint, the change that made it production, and the checkpoint the
    production server reports serving (``serving_in_sync`` when they agree). With a vLLM server the
    answer is the server's own ``/weight_info``; with the in-process engine, the serving watcher's
    report. A server that does not answer is not in sync."""
    row = get_production(session)
    last = None
    if row is not None:
        last = session.scalars(
            select(Promotion).where(Promotion.checkpoint_id == row.id).order_by(Promotion.created_at.desc()).limit(1)
        ).first()
    serving_id, source, updated_at = _served_checkpoint()
    return model_response(
        ProductionOut(
            checkpoint=checkpoint_summaries(session, [row])[0] if row else None,
            last_change=PromotionOut.model_validate(last) if last else None,
            serving_checkpoint_id=serving_id,
            serving_source=source,
            serving_updated_at=updated_at,
            serving_in_sync=bool(row and serving_id == row.id),
        )
    )


def _served_checkpoint() -> tuple[str | None, str | None, str | None]:
    """``(checkpoint id, source, updated_at)`` of what production serves (see :func:`production`)."""
    serving = get_settings().serving
    if serving.engine == "vllm" and serving.url:
        key = serving.api_key.get_secret_value() if serving.api_key else None
        version = served_weight_version(serving.url, api_key=key)
        return version, ("server" if version else None), datetime.now(UTC).isoformat() if version else None
    report = read_serving_state() or {}
    served = report.get("checkpoint_id")
    return served, ("watcher_report" if served else None), report.get("updated_at")

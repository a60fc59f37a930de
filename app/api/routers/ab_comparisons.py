"""``/v1/ab-comparisons``: the stored ``flywheel ab`` results, the fresh-traffic learning curve (read only)."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query, Response

from app.api.deps import SessionDep, ViewerDep
from app.api.errors import AUTH_RESPONSES, model_response
from app.api.online_schemas import ABComparisonOut
from app.api.schemas import CHECKPOINT_ID_PATTERN, Page
from app.promotion import queries
from app.repositories.ab_comparisons import list_ab_comparisons

router = APIRouter(prefix="/ab-comparisons", tags=["ab"], responses=AUTH_RESPONSES)


@router.get("", response_model=Page[ABComparisonOut], summary="A/B results on fresh traffic, newest first")
def ab_comparisons(
    session: SessionDep,
    _: ViewerDep,
    limit: Annotated[int, Query(ge=1, le=500)] = 50,
    cursor: Annotated[str | None, Query(max_length=512)] = None,
    checkpoint_id: Annotated[
        str | None, Query(max_length=128, pattern=CHECKPOINT_ID_PATTERN, description="only this compared arm")
    ] = None,
) -> Response:
    """Every stored ``flywheel ab`` result, newest first: pass rate of both arms with the 95 %
    interval of their difference, and every product signal with its intervals."""
    before = None
    if cursor:
        before = queries.decode_id_cursor(cursor)
    rows = list_ab_comparisons(session, limit=limit + 1, before_id=before, checkpoint_id=checkpoint_id)
    nxt = queries.encode_cursor([rows[limit - 1].id]) if len(rows) > limit else None
    items = [ABComparisonOut.model_validate(r) for r in rows[:limit]]
    return model_response(Page[ABComparisonOut](items=items, next_cursor=nxt))

"""``/v1/checkpoints``: the registry, lineage, eval reports, rejection."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Path, Query, Response
from sqlalchemy.orm import Session

from app.api.deps import RejecterDep, RoleFirstRoute, SessionDep, ViewerDep
from app.api.errors import AUTH_RESPONSES, CONFLICT, NOT_FOUND, model_response
from app.api.online_schemas import OnlineReport
from app.api.schemas import (
    CHECKPOINT_ID_PATTERN,
    CheckpointDetail,
    CheckpointSummary,
    EvalReport,
    GateSummary,
    Lineage,
    Page,
    RejectRequest,
)
from app.lifecycle.erasure import erasure_reasons
from app.lifecycle.online import online_view
from app.lifecycle.production import latest_gate_decision, lineage
from app.models import Checkpoint, GateDecision
from app.models.checkpoints import CheckpointStatus
from app.promotion import queries
from app.promotion.service import reject_checkpoint
from app.repositories.checkpoints import get_checkpoint

router = APIRouter(prefix="/checkpoints", tags=["checkpoints"], responses=AUTH_RESPONSES, route_class=RoleFirstRoute)
CheckpointPath = Annotated[
    str, Path(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN, description="checkpoint id")
]


def gate_summary(gate: GateDecision | None) -> GateSummary | None:
    """A gate decision with the URL of its report PNG (when the evals wrote one)."""
    if gate is None:
        return None
    out = GateSummary.model_validate(gate)
    if gate.report_path:
        out.report_url = f"/v1/reports/{gate.id}/report.png"
    return out


def checkpoint_summaries(session: Session, rows: list[Checkpoint]) -> list[CheckpointSummary]:
    """Summaries of ``rows``, each flagged one with the audited reason of its flag."""
    reasons = erasure_reasons(session, [r.id for r in rows if r.trained_on_erased])
    out = [CheckpointSummary.model_validate(r) for r in rows]
    for summary in out:
        summary.erasure_reason = reasons.get(
            summary.id, "trained on erased data" if summary.trained_on_erased else None
        )
    return out


@router.get("", response_model=Page[CheckpointSummary], summary="List checkpoints, newest first")
def list_checkpoints(
    session: SessionDep,
    _: ViewerDep,
    status: Annotated[CheckpointStatus | None, Query(description="only this status")] = None,
    limit: Annotated[int, Query(ge=1, le=200)] = 50,
    cursor: Annotated[str | None, Query(max_length=512, description="next_cursor of the previous page")] = None,
) -> Response:
    """Checkpoints ordered by creation time, newest first, keyset-paginated."""
    rows, nxt = queries.list_checkpoints(session, limit=limit, status=status, cursor=cursor)
    return model_response(Page[CheckpointSummary](items=checkpoint_summaries(session, rows), next_cursor=nxt))


@router.get(
    "/{checkpoint_id}",
    response_model=CheckpointDetail,
    responses=NOT_FOUND,
    summary="A checkpoint: manifest, lineage, training metrics",
)
def get_checkpoint_detail(checkpoint_id: CheckpointPath, session: SessionDep, _: ViewerDep) -> CheckpointDetail:
    """Manifest, lineage (parent chain, trajectory count, reward spec, data window), training metrics
    and the latest gate decision."""
    row = get_checkpoint(session, checkpoint_id)
    summary = checkpoint_summaries(session, [row])[0].model_dump()
    return CheckpointDetail(
        **summary,
        path=row.path,
        manifest=row.manifest or {},
        metrics=row.metrics or {},
        lineage=Lineage(**queries.checkpoint_detail(session, row)),
        latest_gate=gate_summary(latest_gate_decision(session, row.id)),
    )


@router.get(
    "/{checkpoint_id}/evals",
    response_model=EvalReport,
    responses=NOT_FOUND,
    summary="Gate decision and eval results versus production",
)
def get_checkpoint_evals(checkpoint_id: CheckpointPath, session: SessionDep, _: ViewerDep) -> EvalReport:
    """The latest gate decision with its reasons, per-suite pass rates with 95% intervals versus the
    production it was compared with, per-task differences, and the link to the report PNG."""
    row = get_checkpoint(session, checkpoint_id)
    view = queries.evals_view(session, row)
    gate = view.pop("gate")
    return EvalReport(
        checkpoint_id=row.id, gate=gate_summary(gate), gate_report=(gate.report if gate else {}) or {}, **view
    )


@router.get(
    "/{checkpoint_id}/online",
    response_model=OnlineReport,
    responses=NOT_FOUND,
    summary="Online product signals: overall, the canary versus production, the lineage",
)
def get_checkpoint_online(checkpoint_id: CheckpointPath, session: SessionDep, _: ViewerDep) -> Response:
    """From finalized sessions served by the checkpoint: edit acceptance, edit persistence,
    dissatisfied follow-ups per session, serving seconds per token, mean reward and sessions, each
    with a 95 % interval clustered by user (delta method, Deng et al. 2018). With a canary: canary
    minus production over the canary's window, its timeline, and the online policy's verdict with
    every reason. ``lineage`` gives the same signals for each ancestor checkpoint."""
    row = get_checkpoint(session, checkpoint_id)
    return model_response(OnlineReport.model_validate(online_view(session, row, lineage_rows=lineage(session, row.id))))


@router.post(
    "/{checkpoint_id}/reject",
    response_model=CheckpointSummary,
    responses={**NOT_FOUND, **CONFLICT},
    summary="Reject a checkpoint (release_manager or service)",
)
def reject(
    checkpoint_id: CheckpointPath, body: RejectRequest, session: SessionDep, principal: RejecterDep
) -> CheckpointSummary:
    """Mark a candidate (or gated checkpoint) ``rejected``; audited and announced as
    ``checkpoint.rejected``. Production and retired checkpoints cannot be rejected (409)."""
    row = reject_checkpoint(session, checkpoint_id=checkpoint_id, actor=principal.name, reason=body.reason)
    session.commit()
    return CheckpointSummary.model_validate(row)

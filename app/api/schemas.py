"""Request and response models of the promotion API (pydantic v2; these ARE the OpenAPI schema);
the canary, online-signal and A/B ones are :mod:`app.api.online_schemas`.

Invariant: every free-text input is valid UTF-8 without NUL (Postgres refuses NUL in text), and
every checkpoint id matches :data:`CHECKPOINT_ID_PATTERN`, so bad input is a 422, never a 500.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from app.models.checkpoints import CheckpointStatus, GateVerdict

CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}$"
#: What a gate decides (``overridden`` is a release manager's act, never a gate's).
GateDecisionValue = Literal[
    GateVerdict.PASS, GateVerdict.FAIL, GateVerdict.INSUFFICIENT_EVIDENCE, GateVerdict.NOT_GATED
]
#: A checkpoint's ``decision`` column: the latest gate's verdict, or ``overridden``.
CheckpointDecision = GateVerdict


def _storable(value: str) -> str:
    if "\x00" in value:
        raise ValueError("text must not contain NUL characters")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("text must be valid UTF-8 (no lone surrogates)") from None
    return value


CheckpointId = Annotated[
    str, Field(min_length=1, max_length=128, pattern=CHECKPOINT_ID_PATTERN, examples=["ckpt-0003"])
]
Reason = Annotated[
    str, Field(min_length=1, max_length=2000, description="why (recorded in the audit log)"), AfterValidator(_storable)
]


def _written(value: str) -> str:
    if not value.strip():
        raise ValueError("must be written out, not blank")
    return value


OverrideReason = Annotated[
    str,
    Field(
        min_length=1,
        max_length=2000,
        description="why promote although the gate found insufficient evidence (recorded in the audit log)",
    ),
    AfterValidator(_storable),
    AfterValidator(_written),
]
T = TypeVar("T")


class RequestModel(BaseModel):
    """A request body: an unknown field is a 422, never silently dropped."""

    model_config = ConfigDict(extra="forbid")


class ResponseModel(BaseModel):
    """A response read from ORM rows (``from_attributes``)."""

    model_config = ConfigDict(from_attributes=True)


class ErrorDetail(BaseModel):
    """What went wrong: a stable machine-readable ``code``, a message and every reason."""

    code: str = Field(examples=["conflict"])
    message: str
    reasons: list[str] = Field(default_factory=list)


class ErrorBody(BaseModel):
    """The body of every 4xx/5xx answer."""

    error: ErrorDetail


class Page(BaseModel, Generic[T]):
    """One page; pass ``next_cursor`` as ``cursor`` for the next (null: last page)."""

    items: list[T]
    next_cursor: str | None = None


class CheckpointSummary(ResponseModel):
    """A checkpoint row as listed."""

    id: str
    parent_id: str | None
    status: CheckpointStatus
    decision: CheckpointDecision | None = Field(
        default=None,
        description="what its latest gate decided, or overridden when a release manager promoted over it "
        "(null until gated)",
    )
    generation: int
    stable: bool
    reward_spec: str | None
    num_trajectories: int
    trained_on_erased: bool
    erasure_flagged_at: datetime | None = None
    erasure_reason: str | None = Field(
        default=None,
        description="why it is flagged trained_on_erased: it trained on an erased user's data, or descends from "
        "a checkpoint that did (null when not flagged)",
    )
    created_at: datetime
    promoted_at: datetime | None


class Lineage(BaseModel):
    """Where a checkpoint came from."""

    parent_chain: list[str] = Field(description="parent first, back to the base model")
    trajectory_count: int
    reward_spec: str | None
    data_window: dict[str, Any] = Field(description="start/end of its training data; watermark when known")


class GateSummary(ResponseModel):
    """A gate decision on a candidate versus the production it was compared with."""

    id: uuid.UUID
    candidate_id: str
    production_id: str
    passed: bool
    decision: GateDecisionValue = Field(
        description="what the gate decided (insufficient_evidence and not_gated: not a pass; a release manager "
        "may promote over them with a written override)"
    )
    reasons: list[Any]
    created_at: datetime
    report_url: str | None = Field(default=None, description="the report PNG served by this API")


class CheckpointDetail(CheckpointSummary):
    """A checkpoint with its manifest, lineage, training metrics and latest gate decision."""

    path: str
    manifest: dict[str, Any]
    metrics: dict[str, Any]
    lineage: Lineage
    latest_gate: GateSummary | None


class Rate(BaseModel):
    """A pass rate with its 95% Wilson interval."""

    passed: int
    n: int
    pass_rate: float | None
    ci_low: float
    ci_high: float


class SuiteComparison(BaseModel):
    """One suite: candidate versus the production the gate compared against."""

    suite: str
    suite_version: str
    candidate_run_id: uuid.UUID | None
    production_run_id: uuid.UUID | None
    candidate: Rate
    production: Rate
    diff: float | None = Field(description="candidate - production pass rate")
    diff_ci_low: float = Field(description="95% Newcombe interval of the difference")
    diff_ci_high: float


class TaskDiff(BaseModel):
    """A task whose pass rate differs between candidate and production."""

    suite: str
    task_id: str
    candidate_pass_rate: float
    production_pass_rate: float
    change: Literal["improved", "regressed"]


class EvalReport(BaseModel):
    """Everything a release manager reads before promoting."""

    checkpoint_id: str
    gate: GateSummary | None
    production_id: str | None = Field(description="the checkpoint the gate compared against")
    suites: list[SuiteComparison]
    task_diffs: list[TaskDiff] = Field(description="regressions first")
    task_diffs_truncated: bool
    gate_report: dict[str, Any] = Field(default_factory=dict, description="the gate's own report, verbatim")


class PromotionRequest(RequestModel):
    """Make a gate-passed candidate production."""

    checkpoint_id: CheckpointId
    reason: Reason
    expected_production_id: CheckpointId | None = Field(
        description="the production you saw; refused with 409 if it changed since (optimistic concurrency)"
    )
    override_reason: OverrideReason | None = Field(
        default=None,
        description="only for a candidate whose latest gate ended insufficient_evidence: a release "
        "manager's written reason to promote it anyway (needs the override permission; 403 without "
        "it, 422 when blank, 409 for any other gate outcome); audited as gate.overridden",
    )


class RollbackRequest(RequestModel):
    """Return production to an earlier production checkpoint."""

    reason: Reason
    expected_production_id: CheckpointId | None
    checkpoint_id: CheckpointId | None = Field(
        default=None, description="an earlier production checkpoint; default: the one before the current"
    )


class RejectRequest(RequestModel):
    """Take a candidate out of the running."""

    reason: Reason


class PromotionOut(ResponseModel):
    """A production change (promotion or rollback)."""

    id: uuid.UUID
    kind: str
    checkpoint_id: str
    previous_production_id: str | None
    actor: str
    reason: str
    gate_decision_id: uuid.UUID | None
    created_at: datetime


class ProductionOut(BaseModel):
    """The production checkpoint and what serving actually runs."""

    checkpoint: CheckpointSummary | None
    last_change: PromotionOut | None
    serving_checkpoint_id: str | None = Field(
        description="what the production server itself reports serving (its /weight_info); "
        "the serving watcher's report where the engine is in-process"
    )
    serving_source: Literal["server", "watcher_report"] | None = Field(
        default=None, description="where serving_checkpoint_id was read; None when nothing answered"
    )
    serving_updated_at: str | None
    serving_in_sync: bool


class AuditEntry(ResponseModel):
    """One append-only audit record."""

    id: int
    actor: str
    action: str
    target: str | None
    details: dict[str, Any]
    created_at: datetime


class Me(BaseModel):
    """The caller as the API sees it."""

    name: str
    role: str
    permissions: list[str]


class Health(BaseModel):
    """Liveness."""

    status: Literal["ok"]


class Readiness(BaseModel):
    """Readiness: every dependency reachable."""

    status: Literal["ready"]
    checks: dict[str, str]

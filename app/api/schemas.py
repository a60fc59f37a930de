"""Request and response models of the promotion API (pydantic v2; these ARE the OpenAPI schema).

Invariant: every free-text input is valid UTF-8 without NUL (Postgres refuses NUL in text), and
every checkpoint id matches :data:`CHECKPOINT_ID_PATTERN`, so bad input is a 422, never a 500.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Annotated, Any, Generic, Literal, TypeVar

from pydantic import AfterValidator, BaseModel, ConfigDict, Field

CHECKPOINT_ID_PATTERN = r"^[A-Za-z0-9][A-Za-z0-9._:+@-]{0,127}$"
CheckpointStatus = Literal["candidate", "gate_passed", "gate_failed", "production", "retired", "rejected"]
GateDecisionValue = Literal["pass", "fail", "insufficient_evidence", "not_gated"]
CheckpointDecision = Literal["pass", "fail", "insufficient_evidence", "not_gated", "overridden"]


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


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _Out(BaseModel):
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


class CheckpointSummary(_Out):
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


class GateSummary(_Out):
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


class PromotionRequest(_In):
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


class RollbackRequest(_In):
    """Return production to an earlier production checkpoint."""

    reason: Reason
    expected_production_id: CheckpointId | None
    checkpoint_id: CheckpointId | None = Field(
        default=None, description="an earlier production checkpoint; default: the one before the current"
    )


class RejectRequest(_In):
    """Take a candidate out of the running."""

    reason: Reason


class PromotionOut(_Out):
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


class AuditEntry(_Out):
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


class CanaryRequest(_In):
    """Serve a gate-passed candidate to a sticky fraction of users beside production."""

    checkpoint_id: CheckpointId
    fraction: float = Field(
        gt=0, lt=1, examples=[0.1], description="share of users served by the candidate (sticky by user id hash)"
    )
    reason: Reason


class CanaryStopRequest(_In):
    """Why a canary is stopped."""

    reason: Reason


class CanaryOut(_Out):
    """A canary: who started it, its split, and its window."""

    id: uuid.UUID
    checkpoint_id: str
    production_id: str
    fraction: float
    status: Literal["active", "stopped"]
    actor: str
    reason: str
    gate_decision_id: uuid.UUID | None
    started_at: datetime
    stopped_at: datetime | None
    stopped_by: str | None
    stop_reason: str | None
    ready_at: datetime | None = Field(
        default=None,
        description="when the canary policy found it ran its planned size with no signal regressed "
        "(ready for promotion); null until then",
    )


class CanaryStatusOut(BaseModel):
    """The active canary (null when none) and the most recent ones."""

    active: CanaryOut | None
    recent: list[CanaryOut]


class SignalValue(BaseModel):
    """One signal of one checkpoint: the ratio and its 95 % interval clustered by user."""

    value: float
    low: float
    high: float
    se: float
    users: int
    sessions: int


class SignalSummary(BaseModel):
    """Every online signal of one checkpoint over a set of sessions (null: not defined yet)."""

    sessions: int
    users: int
    signals: dict[str, SignalValue | None]


class SignalDiffOut(BaseModel):
    """canary - production of one signal, with its interval; ``regressed`` when the interval lies
    wholly on the bad side of 0."""

    unit: str
    higher_is_better: bool
    canary: float | None
    production: float | None
    diff: float | None
    low: float | None
    high: float | None
    regressed: bool


class TimelinePoint(BaseModel):
    """The comparison on the sessions started up to ``at``."""

    at: datetime
    canary_sessions: int
    production_sessions: int
    signals: dict[str, SignalDiffOut]


class CanaryComparison(BaseModel):
    """The newest canary of a checkpoint versus the production it ran beside."""

    id: uuid.UUID
    status: str
    fraction: float
    production_id: str
    started_at: datetime
    stopped_at: datetime | None
    canary_sessions: int
    production_sessions: int
    signals: dict[str, SignalDiffOut]
    policy_passed: bool
    policy_reasons: list[str]
    timeline: list[TimelinePoint]


class OnlinePolicyOut(BaseModel):
    """The online policy the checkpoint's gate decision stored."""

    required: bool
    min_sessions: int
    signals: list[str]
    confidence: float


class LineageSignals(SignalSummary):
    """The online signals of one checkpoint of the lineage."""

    checkpoint_id: str
    status: str


class OnlineReport(BaseModel):
    """Online product signals of a checkpoint: overall, its canary, and across its lineage."""

    checkpoint_id: str
    policy: OnlinePolicyOut
    overall: SignalSummary
    canary: CanaryComparison | None
    lineage: list[LineageSignals]


class ABMetricOut(BaseModel):
    """One metric of an A/B in its unit (rates as fractions): both arms and the paired difference
    ``final - base``, each with its interval clustered by task (null: undefined, e.g. no edit to
    persist or fewer than two tasks)."""

    base: float | None
    final: float | None
    diff: float | None
    ci: tuple[float, float] | None = Field(description="interval of diff")
    base_ci: tuple[float, float] | None = None
    final_ci: tuple[float, float] | None = None
    higher_is_better: bool


class ABComparisonOut(_Out):
    """One ``flywheel ab`` result: ``checkpoint_id`` against ``base_id`` on fresh traffic (the same
    requests served by both, answered by the same simulated developers)."""

    id: int
    created_at: datetime
    label: str | None = Field(description="names the run, e.g. cycle-2 (the demo's cycle)")
    base_id: str
    checkpoint_id: str = Field(description="the compared arm: on the demo's curve, the checkpoint serving")
    pairs: int = Field(description="(task, sample) pairs both arms completed")
    tasks: int
    samples: int = Field(description="sessions per task and arm asked for")
    confidence: float = Field(description="level of every interval")
    base_pass_rate: float | None
    pass_rate: float | None
    pass_rate_diff: float | None
    diff_ci_low: float | None
    diff_ci_high: float | None
    pass_rate_lower_bound: float | None = Field(description="one-sided lower bound of pass_rate_diff")
    metrics: dict[str, ABMetricOut] = Field(
        description="pass_rate, edit_acceptance, edit_persistence, dissatisfied_followup_rate, "
        "mean_completion_tokens, mean_latency_s"
    )
    config: dict[str, Any] = Field(description="the A/B settings: difficulty mix, seed, budgets")
    detail: dict[str, Any] = Field(description="source, split, tasks_by_difficulty, sessions, errors")

"""Request and response models of the API's online side: canaries, the online product signals per
checkpoint and the paired A/B results (pydantic v2; these ARE the OpenAPI schema).

Invariant: as in :mod:`app.api.schemas`, every free-text input is valid UTF-8 without NUL and every
checkpoint id matches its pattern, so bad input is a 422, never a 500.
"""

from __future__ import annotations

import uuid
from datetime import datetime
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.api.schemas import CheckpointId, Reason, RequestModel, ResponseModel


class CanaryRequest(RequestModel):
    """Serve a gate-passed candidate to a sticky fraction of users beside production."""

    checkpoint_id: CheckpointId
    fraction: float = Field(
        gt=0, lt=1, examples=[0.1], description="share of users served by the candidate (sticky by user id hash)"
    )
    reason: Reason


class CanaryStopRequest(RequestModel):
    """Why a canary is stopped."""

    reason: Reason


class CanaryOut(ResponseModel):
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


class ABComparisonOut(ResponseModel):
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

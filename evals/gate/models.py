"""The gate's data: outcomes in (detached ``eval_result`` rows) and reports out (pydantic models).

Invariant: these are plain values with no DB or IO; a report model is everything the stored
``gate_decision.report`` and the files of :mod:`evals.report` say about a suite.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, Field

from app.models.checkpoints import GateVerdict

Key = tuple[str, int]
Decision = Literal[GateVerdict.PASS, GateVerdict.FAIL, GateVerdict.INSUFFICIENT_EVIDENCE]
"""How the gate ends: ``pass``, the intervals clear every gated suite's threshold; ``fail``, a
check shows a problem (a regression, a breached floor or monitor, missing or broken results) or no
suite was gated; ``insufficient_evidence``, nothing failed but some interval still reaches below
its threshold on a suite without the power to call that a failure (or too few pairs)."""
SuiteDecision = Literal[GateVerdict.PASS, GateVerdict.FAIL, GateVerdict.INSUFFICIENT_EVIDENCE, GateVerdict.NOT_GATED]
"""How one suite ends: a :data:`Decision`, or ``not_gated`` for a suite allowed to be empty that
had nothing to compare (reported, never a pass, and not counted by the gate)."""


@dataclass(frozen=True)
class Outcome:
    """One sample of one task in an eval run (an ``eval_result`` row, detached from the DB)."""

    task_id: str
    sample_index: int
    passed: bool
    completion_tokens: int = 0
    latency_s: float = 0.0
    tool_calls: int = 0
    tool_call_errors: int = 0
    asked_question: bool = False
    edited: bool = False
    error: str | None = None
    sandbox_denials: int = 0

    @property
    def key(self) -> Key:
        return (self.task_id, self.sample_index)


@dataclass(frozen=True)
class SuiteOutcomes:
    """A checkpoint's outcomes on one suite. ``planned`` are the keys the run set out to produce
    (None: whatever is in ``outcomes`` was the plan); ``stopped``: the run stopped early because
    its confidence sequence decided (``eval_run.status = 'stopped'``, ``GateConfig.early_stop``),
    so only a prefix of its clusters was run."""

    suite: str
    suite_version: str
    outcomes: Sequence[Outcome]
    planned: Sequence[Key] | None = None
    run_id: str | None = None
    checkpoint_id: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    stopped: bool = False


class GateReason(BaseModel):
    """One check's verdict: human-readable ``message`` plus machine fields."""

    check: str = Field(
        description="missing_suite | version_mismatch | missing_results | unpaired | errors | "
        "too_few_pairs | power | non_inferiority | superiority | floor | monitor | empty_suite | "
        "stopped_early | no_gated_suites"
    )
    suite: str | None = None
    gated: bool = True
    passed: bool
    message: str
    metric: str | None = None
    value: float | None = None
    bound: float | None = None
    details: dict[str, Any] = Field(default_factory=dict)
    inconclusive: bool = Field(
        default=False,
        description="a failed check that shows no problem, only that the pairs cannot decide "
        "(insufficient evidence, not a failure)",
    )
    informational: bool = Field(
        default=False,
        description="reported beside the decision and never part of it (the power figure)",
    )


class PassRate(BaseModel):
    """A pass rate over ``n`` outcomes with a two-sided Wilson score interval."""

    rate: float
    low: float
    high: float
    n: int


class MonitorReport(BaseModel):
    """One behaviour statistic, candidate vs production, and its bound.

    ``drift`` is the observed change in the bad direction (production - candidate when ``worse`` is
    ``decrease``), in the metric's unit; ``drift_low``/``drift_high`` its confidence interval (None
    under the point rule, or for ``p90_latency_s``); ``rule`` the comparison that decided (see
    :attr:`evals.gate.policy.GateConfig.monitor_rule`)."""

    metric: str
    candidate: float
    production: float
    allowed_drift: float | None
    limit: float | None
    worse: str
    passed: bool
    drift: float = 0.0
    drift_low: float | None = None
    drift_high: float | None = None
    rule: str = "point"


class SamplingReport(BaseModel):
    """pass@k and best-of-K of one checkpoint on one suite (:func:`evals.gate.passk.sampling_report`).

    ``pass_at_k`` maps ``k`` (as a string, JSON keys) to the unbiased estimate of Chen et al. (2021,
    eq. 1) averaged over tasks, for k in {1, ``samples_per_task``}; ``best_of_k`` is the share of
    tasks with at least one passing sample among their ``samples_per_task`` samples (oracle best-of-K:
    the hidden tests are the verifier; ``best_of_k_tasks`` of ``n_tasks`` such tasks)."""

    samples_per_task: int
    n_tasks: int
    pass_at_k: dict[str, float]
    best_of_k: float
    best_of_k_tasks: int


class SequentialReport(BaseModel):
    """The anytime-valid view of one suite (:mod:`evals.gate.sequential`): clusters in a seeded random
    order, one look after each, bounds of the mean over clusters of each cluster's mean paired
    difference (one-sided, each at the gate's confidence)."""

    low: float = Field(description="the sequence's lower bound where it stopped (else after the last cluster)")
    high: float = Field(description="its upper bound there")
    clusters: int = Field(description="clusters (templates, or tasks) in the suite")
    stopped_at_clusters: int | None = Field(
        default=None, description="clusters seen when a bound first decided; None: it never did"
    )
    stopped_at_pairs: int | None = Field(
        default=None, description="paired outcomes in those clusters; None: the sequence never decided"
    )
    decision: Decision = Field(description="what the sequence says (the suite's decision under decide_by = sequential)")


class SuiteReport(BaseModel):
    """Statistics of one suite on the paired outcomes."""

    suite: str
    gated: bool
    suite_version: str | None
    passed: bool
    decision: SuiteDecision = GateVerdict.FAIL
    role: str = Field(default="guardrail", description="guardrail (non-inferiority) or success (superiority)")
    check: str = Field(
        default="non_inferiority",
        description="a guardrail's test: non_inferiority (lower bound above -margin) or deterioration "
        "(fails only when the interval lies wholly below 0; floor and monitors decide otherwise)",
    )
    threshold: float | None = Field(
        default=None, description="the bound the deciding lower bound must clear: -margin, or 0 for a success suite"
    )
    decided_by: str = Field(default="interval", description="interval (fixed n) or sequential")
    clusters: int = Field(default=0, description="clusters the intervals resample (templates or tasks)")
    sequential: SequentialReport | None = None
    stopped_at_pairs: int | None = Field(
        default=None,
        description="pairs at which the deciding bounds decided: where the confidence sequence stopped "
        "under decide_by = sequential, else all pairs; None without a decision",
    )
    run_stopped: bool = Field(
        default=False,
        description="the candidate's run stopped there (early_stop): the rest of the plan never ran",
    )
    planned_pairs: int | None = Field(
        default=None, description="pairs the plan holds (more than n_pairs when the run stopped early)"
    )
    power: float | None = Field(
        default=None,
        description="probability that an equal candidate clears the margin at the plan's pairs "
        "(planned_pairs, else n_pairs) and production's rate (evals.gate.power); None without pairs",
    )
    margin: float | None = Field(default=None, description="the non-inferiority margin the power is for")
    n_pairs: int
    n_tasks: int
    candidate: PassRate | None = None
    production: PassRate | None = None
    diff: float | None = None
    diff_low: float | None = None
    diff_high: float | None = None
    method: str
    candidate_only: int = 0
    production_only: int = 0
    monitors: list[MonitorReport] = Field(default_factory=list)
    newly_solved: list[str] = Field(default_factory=list)
    newly_broken: list[str] = Field(default_factory=list)
    samples_per_task: int = 1
    candidate_sampling: SamplingReport | None = None
    production_sampling: SamplingReport | None = None


class GateResult(BaseModel):
    """The gate's decision with every reason (passing and failing) and per-suite statistics.
    ``passed`` is ``decision is GateVerdict.PASS``."""

    passed: bool
    decision: Decision = GateVerdict.FAIL
    reasons: list[GateReason]
    suites: dict[str, SuiteReport]
    config: dict[str, Any]

    def failures(self) -> list[GateReason]:
        """The reasons that kept a gated suite from passing, failed or inconclusive (empty when
        ``passed``); the informational power figure is never one."""
        return [r for r in self.reasons if not r.passed and r.gated and not r.informational]

    def decisions(self) -> dict[str, Any]:
        """The decision in brief, for a bench's JSON: ``{"decision": str, "suites": {name:
        {"decision", "gated", "role", "decided_by", "power", "stopped_at_pairs", "run_stopped",
        "n_pairs", "planned_pairs", "diff", "low", "high", "sequence"}}}``: ``low``/``high`` the fixed-n interval, ``sequence`` the
        confidence sequence's ``[low, high]`` where it stopped (differences as pass-rate fractions;
        None without pairs)."""
        return {
            "decision": self.decision,
            "suites": {
                n: {
                    "decision": s.decision,
                    "gated": s.gated,
                    "role": s.role,
                    "decided_by": s.decided_by,
                    "power": s.power,
                    "stopped_at_pairs": s.stopped_at_pairs,
                    "run_stopped": s.run_stopped,
                    "n_pairs": s.n_pairs,
                    "planned_pairs": s.planned_pairs,
                    "diff": s.diff,
                    "low": s.diff_low,
                    "high": s.diff_high,
                    "sequence": None if s.sequential is None else [s.sequential.low, s.sequential.high],
                }
                for n, s in self.suites.items()
            },
        }

"""What the loop report holds (:class:`LoopReport`) and how its gate numbers read as text; shared by
:mod:`ops.report` (which collects and writes it) and :mod:`ops.report_terminal` (which prints it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from evals.gate.passk import format_pass_at_k


@dataclass
class SuiteResult:
    """Pass rate of one checkpoint on one suite."""

    checkpoint_id: str
    suite: str
    passed: int
    total: int
    low: float
    high: float
    mean_completion_tokens: float
    tool_call_errors: int
    samples_per_task: int = 1
    pass_at_k: dict[str, float] = field(default_factory=dict)
    """Unbiased pass@k (Chen et al. 2021, eq. 1) by k, mean over tasks (``evals.gate.passk``)."""
    best_of_k: float | None = None
    """Share of tasks with a passing sample among their ``samples_per_task`` samples."""

    @property
    def pass_at_k_text(self) -> str:
        """``pass@1 52.0% · pass@4 81.3% · best-of-4 81.3%``."""
        return format_pass_at_k(self.pass_at_k, self.samples_per_task, self.best_of_k)

    @property
    def rate(self) -> float:
        return self.passed / self.total if self.total else 0.0


@dataclass
class LoopReport:
    """What the loop did, read back from Postgres and the checkpoint store."""

    generated_at: str
    events_by_type: dict[str, int]
    dead_letters_by_reason: dict[str, int]
    privacy_events_dropped: int
    trajectories_by_status: dict[str, int]
    reward_spec: str | None
    rewards: list[float]
    candidate_id: str | None
    candidate_parent_id: str | None
    candidate_status: str | None
    training_metrics: dict[str, Any]
    trajectories_trained: int
    training_history: list[dict[str, Any]] = field(default_factory=list)
    suites: list[SuiteResult] = field(default_factory=list)
    gate_passed: bool | None = None
    gate_decision: str | None = None
    """The candidate's latest gate decision: pass, fail or insufficient_evidence."""
    gate_reasons: list[str] = field(default_factory=list)
    gate_report_path: str | None = None
    production_id: str | None = None
    audit: list[dict[str, Any]] = field(default_factory=list)
    curves: list[dict[str, Any]] = field(default_factory=list)
    multi_segment_sessions: int = 0
    """Sessions (trajectories) with more than one segment: the agent self-summarized at least once."""
    gates: list[dict[str, Any]] = field(default_factory=list)
    """Every gate decision, oldest first: ``{"decision_id", "candidate_id", "production_id",
    "decision", "suites": {suite: {"decision", "power", "margin", "n_pairs", "diff", "diff_low",
    "diff_high"}}}`` over the gated suites."""

    @property
    def total_events(self) -> int:
        return sum(self.events_by_type.values())


def fmt_counts(counts: dict[str, int]) -> str:
    """``finalized 43, open 2`` (keys sorted), or ``none``: counts read as a sentence, never a dict."""
    return ", ".join(f"{k} {v}" for k, v in sorted(counts.items())) or "none"


def fmt_power(power: float | None) -> str:
    """``0.93``, or ``-`` without pairs."""
    return "-" if power is None else f"{power:.2f}"


def fmt_diff(diff: float | None, low: float | None, high: float | None) -> str:
    """``-2.1 pt [-6.0, +1.8]`` (pass-rate points), or ``-``."""
    if diff is None or low is None or high is None:
        return "-"
    return f"{100 * diff:+.1f} pt [{100 * low:+.1f}, {100 * high:+.1f}]"

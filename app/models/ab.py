"""A/B comparisons on fresh traffic (written by ``flywheel ab``, read by the API and its dashboard).

One row per completed ``flywheel ab BASE FINAL``: the paired comparison of ``checkpoint_id`` (FINAL)
against ``base_id`` (``ops.ab.compare_arms``), with the pass rate's paired difference and its interval
in columns and every metric with its intervals in ``metrics``. Rows are inserted, never changed;
read newest first they are the learning curve of the checkpoints that served.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from sqlalchemy import BigInteger, Float, Index, Integer, String, Text
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import Mapped, mapped_column

from app.models.base import Base, created_at_column


class ABComparison(Base):
    """One A/B of ``checkpoint_id`` against ``base_id`` on fresh traffic.

    Rates are fractions in [0, 1] (None where undefined: no completed pair); ``diff_ci_low`` and
    ``diff_ci_high`` bound ``pass_rate - base_pass_rate`` at ``confidence`` (two-sided, clustered by
    task); ``pass_rate_lower_bound`` is its one-sided bound at the same level.
    """

    __tablename__ = "ab_comparison"

    id: Mapped[int] = mapped_column(BigInteger, primary_key=True, autoincrement=True)
    created_at: Mapped[datetime] = created_at_column()
    label: Mapped[str | None] = mapped_column(String(128), comment="free text naming the run, e.g. cycle-2")
    base_id: Mapped[str] = mapped_column(String(128), nullable=False, comment="the baseline arm's checkpoint")
    checkpoint_id: Mapped[str] = mapped_column(
        String(128), nullable=False, comment="the compared arm's checkpoint (the served one on a curve)"
    )
    pairs: Mapped[int] = mapped_column(Integer, nullable=False, comment="(task, sample) pairs both arms completed")
    tasks: Mapped[int] = mapped_column(Integer, nullable=False, comment="distinct tasks among the pairs")
    samples: Mapped[int] = mapped_column(Integer, nullable=False, comment="sessions per task and arm asked for")
    confidence: Mapped[float] = mapped_column(Float, nullable=False, comment="level of every interval")
    base_pass_rate: Mapped[float | None] = mapped_column(Float)
    pass_rate: Mapped[float | None] = mapped_column(Float)
    pass_rate_diff: Mapped[float | None] = mapped_column(Float, comment="pass_rate - base_pass_rate")
    diff_ci_low: Mapped[float | None] = mapped_column(Float)
    diff_ci_high: Mapped[float | None] = mapped_column(Float)
    pass_rate_lower_bound: Mapped[float | None] = mapped_column(
        Float, comment="one-sided lower bound of pass_rate_diff at confidence"
    )
    metrics: Mapped[dict[str, Any]] = mapped_column(
        JSONB,
        nullable=False,
        comment="metric -> {base, final, diff, ci, base_ci, final_ci, higher_is_better} (ops.ab.METRICS)",
    )
    config: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, comment="the A/B settings: mix, seed, budgets (ops.ab.ABConfig)"
    )
    detail: Mapped[dict[str, Any]] = mapped_column(
        JSONB, nullable=False, comment="source, split, tasks_by_difficulty, sessions ran/reused, errors"
    )
    report_path: Mapped[str | None] = mapped_column(Text, comment="the JSON report flywheel ab wrote")

    __table_args__ = (Index("ix_ab_comparison_checkpoint_id", "checkpoint_id"),)

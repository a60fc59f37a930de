"""A/B comparisons on fresh traffic: one row per ``flywheel ab`` result (``app.models.ABComparison``).

Invariant: a row holds the report as ``ops.ab.run_ab`` returned it (the pass rate's paired difference
in columns, every metric with its intervals in ``metrics``); rows are inserted, never updated.
Functions flush, never commit: the caller's boundary owns the transaction.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from app.models import ABComparison

MAX_STORED_ERRORS = 20
"""Error messages of failed sessions kept in ``detail`` (all are counted)."""


def record_ab_comparison(
    session: Session, report: dict[str, Any], *, label: str | None = None, report_path: str | None = None
) -> ABComparison:
    """Insert one A/B result and flush.

    Args:
        report: what ``ops.ab.run_ab`` returns (``flywheel ab --json`` prints it): ``base``,
            ``final``, ``pairs``, ``tasks``, ``confidence``, ``pass_rate_lower_bound``, ``metrics``
            (each ``{"base", "final", "diff", "ci", ...}``, ``metrics["pass_rate"]`` required),
            ``config`` (``samples`` required) and, optionally, ``source``, ``split``,
            ``tasks_by_difficulty``, ``sessions`` and ``errors``.
        label: names the run on a curve, e.g. ``cycle-2`` (the demo passes its cycle).
        report_path: where the JSON report was written.

    Raises:
        KeyError: ``report`` lacks a required key.
    """
    passed = report["metrics"]["pass_rate"]
    ci = passed["ci"] or (None, None)
    errors = list(report.get("errors", []))
    row = ABComparison(
        label=label,
        base_id=report["base"],
        checkpoint_id=report["final"],
        pairs=report["pairs"],
        tasks=report["tasks"],
        samples=report["config"]["samples"],
        confidence=report["confidence"],
        base_pass_rate=passed["base"],
        pass_rate=passed["final"],
        pass_rate_diff=passed["diff"],
        diff_ci_low=ci[0],
        diff_ci_high=ci[1],
        pass_rate_lower_bound=report["pass_rate_lower_bound"],
        metrics=report["metrics"],
        config=report["config"],
        detail={
            "source": report.get("source"),
            "split": report.get("split"),
            "tasks_by_difficulty": report.get("tasks_by_difficulty", {}),
            "sessions": report.get("sessions", {}),
            "error_count": len(errors),
            "errors": errors[:MAX_STORED_ERRORS],
        },
        report_path=report_path,
    )
    session.add(row)
    session.flush()
    return row


def list_ab_comparisons(
    session: Session, *, limit: int, before_id: int | None = None, checkpoint_id: str | None = None
) -> list[ABComparison]:
    """A/B results newest first (by id), ``limit`` of them, strictly older than ``before_id``, of
    ``checkpoint_id`` as the compared arm when given."""
    stmt = select(ABComparison).order_by(ABComparison.id.desc()).limit(limit)
    if before_id is not None:
        stmt = stmt.where(ABComparison.id < before_id)
    if checkpoint_id is not None:
        stmt = stmt.where(ABComparison.checkpoint_id == checkpoint_id)
    return list(session.scalars(stmt))

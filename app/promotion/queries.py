"""Read side of the promotion API: checkpoint pages, lineage, eval comparisons, production history.

Invariant: read-only (no flush, no write); pages are keyset-paginated on a total order
(``created_at DESC, id DESC`` for checkpoints) so a page never repeats or skips a row that existed
when the first page was read.
"""

from __future__ import annotations

import base64
import json
import uuid
from collections import defaultdict
from datetime import datetime
from typing import Any

from sqlalchemy import func, select, tuple_
from sqlalchemy.orm import Session, defer

from app.core.errors import FlywheelError
from app.core.intervals import newcombe_diff_interval, wilson_interval
from app.lifecycle.production import latest_gate_decision, lineage
from app.models import (
    Checkpoint,
    CheckpointTrajectory,
    EvalResult,
    EvalRun,
    GateDecision,
    Promotion,
    TrainingCycle,
    Trajectory,
)

MAX_TASK_DIFFS = 500


class InvalidCursorError(FlywheelError):
    """A pagination cursor that this API did not hand out."""

    status_code = 422


def encode_cursor(values: list[Any]) -> str:
    """An opaque cursor for keyset pagination (url-safe base64 of a JSON list)."""
    return base64.urlsafe_b64encode(json.dumps(values, default=str).encode()).decode().rstrip("=")


def decode_cursor(cursor: str, arity: int) -> list[Any]:
    """Values of a cursor made by :func:`encode_cursor`.

    Raises:
        InvalidCursorError: not a cursor of this API (or of another endpoint).
    """
    try:
        values = json.loads(base64.urlsafe_b64decode(cursor + "=" * (-len(cursor) % 4)))
    except (ValueError, UnicodeDecodeError):
        raise InvalidCursorError("invalid cursor", reasons=["pass next_cursor from a previous page"]) from None
    if not isinstance(values, list) or len(values) != arity:
        raise InvalidCursorError("invalid cursor", reasons=["pass next_cursor from a previous page"])
    return values


def decode_id_cursor(cursor: str) -> int:
    """The row id of a one-value cursor (``encode_cursor([id])``): a positive bigint.

    Raises:
        InvalidCursorError: not such a cursor (a bool, a float, or an int outside 1..2**63-1).
    """
    (value,) = decode_cursor(cursor, 1)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 2**63:
        raise InvalidCursorError("invalid cursor", reasons=["pass next_cursor from a previous page"])
    return value


def list_checkpoints(
    session: Session, *, limit: int, status: str | None = None, cursor: str | None = None
) -> tuple[list[Checkpoint], str | None]:
    """A page of checkpoints, newest first, and the cursor of the next page (None at the end).

    Raises:
        InvalidCursorError: a malformed cursor.
    """
    # A listing never shows manifests or metrics: skip loading and decoding that JSONB.
    stmt = (
        select(Checkpoint)
        .options(defer(Checkpoint.manifest), defer(Checkpoint.metrics))
        .order_by(Checkpoint.created_at.desc(), Checkpoint.id.desc())
        .limit(limit + 1)
    )
    if status:
        stmt = stmt.where(Checkpoint.status == status)
    if cursor:
        created, cid = decode_cursor(cursor, 2)
        try:
            created_at = datetime.fromisoformat(str(created))
        except ValueError:
            raise InvalidCursorError("invalid cursor") from None
        stmt = stmt.where(tuple_(Checkpoint.created_at, Checkpoint.id) < tuple_(created_at, str(cid)))
    rows = list(session.scalars(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor([rows[-1].created_at.isoformat(), rows[-1].id]) if more and rows else None
    return rows, nxt


def data_window(session: Session, row: Checkpoint) -> dict[str, Any]:
    """When the trajectories a checkpoint trained on happened.

    Prefers the manifest's ``data_window`` (written by the trainer); else the earliest session start
    and latest finalization of its trajectories still present; plus the training cycle's
    watermark (``max event_log.seq`` used) when known.
    """
    manifest_window = (row.manifest or {}).get("data_window")
    window: dict[str, Any] = dict(manifest_window) if isinstance(manifest_window, dict) else {}
    if "start" not in window or "end" not in window:
        first, last = session.execute(
            select(
                func.min(func.coalesce(Trajectory.started_at, Trajectory.finalized_at)),
                func.max(Trajectory.finalized_at),
            )
            .join(CheckpointTrajectory, CheckpointTrajectory.trajectory_id == Trajectory.id)
            .where(CheckpointTrajectory.checkpoint_id == row.id)
        ).one()
        window.setdefault("start", first.isoformat() if first else None)
        window.setdefault("end", last.isoformat() if last else None)
    cycle = session.scalars(
        select(TrainingCycle)
        .where(TrainingCycle.checkpoint_id == row.id)
        .order_by(TrainingCycle.started_at.desc())
        .limit(1)
    ).first()
    if cycle is not None:
        window.setdefault("watermark_seq", cycle.watermark_seq)
        window.setdefault(
            "watermark_finalized_at", cycle.watermark_finalized_at.isoformat() if cycle.watermark_finalized_at else None
        )
    return window


def checkpoint_detail(session: Session, row: Checkpoint) -> dict[str, Any]:
    """Lineage of a checkpoint: parent chain, trajectory count, reward spec, data window."""
    chain = lineage(session, row.id)
    linked = (
        session.scalar(
            select(func.count()).select_from(CheckpointTrajectory).where(CheckpointTrajectory.checkpoint_id == row.id)
        )
        or 0
    )
    return {
        "parent_chain": [c.id for c in chain[1:]],
        "trajectory_count": max(row.num_trajectories, linked),
        "reward_spec": row.reward_spec or (row.manifest or {}).get("reward_spec"),
        "data_window": data_window(session, row),
    }


def _latest_runs(session: Session, checkpoint_id: str) -> dict[tuple[str, str], EvalRun]:
    runs: dict[tuple[str, str], EvalRun] = {}
    stmt = select(EvalRun).where(EvalRun.checkpoint_id == checkpoint_id).order_by(EvalRun.started_at)
    for run in session.scalars(stmt):
        key = (run.suite, run.suite_version)
        # The latest succeeded run wins; an unfinished run only stands in when nothing succeeded.
        if run.status == "succeeded" or key not in runs or runs[key].status != "succeeded":
            runs[key] = run
    return runs


def _per_task(session: Session, run: EvalRun | None) -> dict[str, list[bool]]:
    out: dict[str, list[bool]] = defaultdict(list)
    if run is None:
        return out
    for task_id, passed in session.execute(
        select(EvalResult.task_id, EvalResult.passed).where(EvalResult.run_id == run.id)
    ):
        out[task_id].append(bool(passed))
    return out


def _rate(k: int, n: int) -> dict[str, Any]:
    low, high = wilson_interval(k, n)
    return {"passed": k, "n": n, "pass_rate": (k / n) if n else None, "ci_low": low, "ci_high": high}


def evals_view(session: Session, row: Checkpoint) -> dict[str, Any]:
    """Gate decision, per-suite pass rates with 95% intervals versus the production compared against,
    and per-task differences (regressions first)."""
    gate = latest_gate_decision(session, row.id)
    baseline_id = gate.production_id if gate else None
    cand_runs = _latest_runs(session, row.id)
    base_runs = _latest_runs(session, baseline_id) if baseline_id else {}
    suites, diffs = [], []
    for key in sorted(set(cand_runs) | set(base_runs)):
        c_run, b_run = cand_runs.get(key), base_runs.get(key)
        c_tasks, b_tasks = _per_task(session, c_run), _per_task(session, b_run)
        ck = sum(sum(v) for v in c_tasks.values())
        cn = sum(len(v) for v in c_tasks.values())
        bk = sum(sum(v) for v in b_tasks.values())
        bn = sum(len(v) for v in b_tasks.values())
        d_low, d_high = newcombe_diff_interval(ck, cn, bk, bn)
        suites.append(
            {
                "suite": key[0],
                "suite_version": key[1],
                "candidate_run_id": c_run.id if c_run else None,
                "production_run_id": b_run.id if b_run else None,
                "candidate": _rate(ck, cn),
                "production": _rate(bk, bn),
                "diff": (ck / cn - bk / bn) if cn and bn else None,
                "diff_ci_low": d_low,
                "diff_ci_high": d_high,
            }
        )
        for task_id in sorted(set(c_tasks) & set(b_tasks)):
            c, b = c_tasks[task_id], b_tasks[task_id]
            cr, br = sum(c) / len(c), sum(b) / len(b)
            if cr != br:
                diffs.append(
                    {
                        "suite": key[0],
                        "task_id": task_id,
                        "candidate_pass_rate": cr,
                        "production_pass_rate": br,
                        "change": "improved" if cr > br else "regressed",
                    }
                )
    diffs.sort(key=lambda d: (d["change"] != "regressed", d["suite"], d["task_id"]))
    return {
        "gate": gate,
        "production_id": baseline_id,
        "suites": suites,
        "task_diffs": diffs[:MAX_TASK_DIFFS],
        "task_diffs_truncated": len(diffs) > MAX_TASK_DIFFS,
    }


def list_promotions(session: Session, *, limit: int, before: str | None = None) -> tuple[list[Promotion], str | None]:
    """Production changes newest first, keyset-paginated on ``(created_at, id)``."""
    stmt = select(Promotion).order_by(Promotion.created_at.desc(), Promotion.id.desc()).limit(limit + 1)
    if before:
        created, pid = decode_cursor(before, 2)
        try:
            created_at = datetime.fromisoformat(str(created))
            pid_uuid = uuid.UUID(str(pid))
        except ValueError:
            raise InvalidCursorError("invalid cursor") from None
        stmt = stmt.where(tuple_(Promotion.created_at, Promotion.id) < tuple_(created_at, pid_uuid))
    rows = list(session.scalars(stmt))
    more = len(rows) > limit
    rows = rows[:limit]
    nxt = encode_cursor([rows[-1].created_at.isoformat(), str(rows[-1].id)]) if more and rows else None
    return rows, nxt


def gate_decision(session: Session, decision_id: uuid.UUID) -> GateDecision | None:
    """A gate decision by id."""
    return session.get(GateDecision, decision_id)

"""What a run of the loop decided and measured, read from the store: its training cycles, each
candidate's gate decision and release, paired held-out comparisons of two checkpoints, stored A/B
comparisons, and seconds per phase from the database's timestamps (``bench/flywheel.py``'s figures:
every one comes from the rows the loop wrote, never from a command's printed output)."""

from __future__ import annotations

from sqlalchemy import Interval, func, select, type_coerce
from sqlalchemy.orm import Session

from app.models import ABComparison, EvalResult, EvalRun, EventLog, GateDecision, Promotion, TrainingCycle
from evals.gate.decision import paired_bootstrap_interval
from evals.tasks.functions import template_of

SUITE = "functions"  # the held-out suite the bench's gates decide on
SIGNALS = (  # the product signals the A/B reports beside the pass rate
    "edit_persistence",
    "dissatisfied_followup_rate",
    "mean_completion_tokens",
    "mean_latency_s",
    "edit_acceptance",
)


def succeeded_cycles(session: Session, since=None, *, min_trajectories: int = 0) -> list[TrainingCycle]:
    """Training cycles that registered a checkpoint, oldest first (started after ``since`` if given;
    with ``min_trajectories``, those that trained on at least that many trajectories: the loop's
    scheduled cycles, not a cycle on a few stragglers)."""
    q = select(TrainingCycle).where(TrainingCycle.status == "succeeded", TrainingCycle.checkpoint_id.is_not(None))
    if since is not None:
        q = q.where(TrainingCycle.started_at > since)
    if min_trajectories:
        q = q.where(TrainingCycle.num_trajectories >= min_trajectories)
    return list(session.scalars(q.order_by(TrainingCycle.started_at)))


def gate_view(session: Session, candidate: str, suite: str = SUITE) -> dict:
    """The newest gate decision of ``candidate``: ``decision`` and, for the held-out suite, ``power``
    and ``stopped_at_pairs`` (None where the gate did not record them)."""
    row = session.scalars(
        select(GateDecision).where(GateDecision.candidate_id == candidate).order_by(GateDecision.created_at.desc())
    ).first()
    if row is None:
        return {"decision": None, "power": None, "stopped_at_pairs": None}
    report = row.report or {}
    held_out = (report.get("suites") or {}).get(suite) or {}
    return {
        "decision": row.decision,
        "power": held_out.get("power"),
        "stopped_at_pairs": held_out.get("stopped_at_pairs"),
    }


def served_after_cycles(session: Session, candidates: list[str]) -> list[dict]:
    """Per cycle: its candidate, the gate's decision, whether and by whom it was promoted, and what
    production serves after it (the base until a candidate is promoted)."""
    promotions = {
        p.checkpoint_id: p.actor for p in session.scalars(select(Promotion).where(Promotion.kind == "promotion"))
    }
    out, serving = [], "base"
    for cycle, candidate in enumerate(candidates, 1):
        if candidate in promotions:
            serving = candidate
        out.append(
            {
                "cycle": cycle,
                "candidate": candidate,
                **gate_view(session, candidate),
                "promoted": candidate in promotions,
                "promoted_by": promotions.get(candidate),
                "checkpoint": serving,
            }
        )
    return out


def paired(session: Session, base: str, final: str, suite: str, *, by_template: bool = False) -> dict:
    """Paired held-out comparison of ``final`` against ``base`` on the newest succeeded runs of one plan,
    paired by (task, sample); the bootstrap clusters by task, or with ``by_template`` by the task's
    template (``evals.tasks.functions.template_of``; as the gate does: the tasks of one template are
    not independent). ``samples`` is the most samples a task has.

    Raises:
        SystemExit: the two were evaluated on different plans, or one was not evaluated.
    """

    def results(ckpt: str) -> tuple[str, dict]:
        runs = select(EvalRun).where(EvalRun.checkpoint_id == ckpt, EvalRun.suite == suite)
        run = session.scalars(runs.where(EvalRun.status == "succeeded").order_by(EvalRun.started_at.desc())).first()
        if run is None:
            stopped = session.scalars(runs.where(EvalRun.status == "stopped")).first()
            why = " (its gate stopped the run early: early_stop in the gate policy; the bench needs it off)"
            raise SystemExit(f"{ckpt} has no succeeded {suite} run" + (why if stopped else ""))
        rows = session.scalars(select(EvalResult).where(EvalResult.run_id == run.id)).all()
        return run.suite_version, {(r.task_id, r.sample_index): bool(r.passed) for r in rows}

    version_b, base_res = results(base)
    version_f, final_res = results(final)
    if version_b != version_f:
        raise SystemExit(f"base and final were evaluated on different plans ({version_b} vs {version_f})")
    keys = sorted(set(base_res) & set(final_res))
    diffs = [int(final_res[k]) - int(base_res[k]) for k in keys]
    clusters = [(template_of(k[0]) or k[0]) if by_template else k[0] for k in keys]
    low, _ = paired_bootstrap_interval(clusters, diffs, confidence=0.95, two_sided=False)
    ci = paired_bootstrap_interval(clusters, diffs, confidence=0.95, two_sided=True)
    n = len(keys)
    return {
        "pairs": n,
        "samples": 1 + max((k[1] for k in keys), default=0),
        "cluster": "template" if by_template else "task",
        "base": sum(base_res[k] for k in keys) / n,
        "final": sum(final_res[k] for k in keys) / n,
        "diff": sum(diffs) / n,
        "ci": list(ci),
        "lower_bound": low,
    }


def eval_seconds(session: Session) -> float:
    """Seconds the eval runs of this home took, each from its start to its finish."""
    total = session.scalar(
        select(func.sum(func.extract("epoch", EvalRun.finished_at - EvalRun.started_at))).where(
            EvalRun.finished_at.is_not(None)
        )
    )
    return float(total or 0.0)


def loop_budget(session: Session) -> dict[str, float]:
    """Seconds per phase of the loop, from the database's timestamps: ``simulate`` (first to last
    event of the traffic), ``train`` (training cycles that ran), ``eval`` (eval runs), ``gate`` (from a
    cycle's end to its candidate's decision, evals excluded), ``release`` (decision to promotion)."""
    first, last = session.execute(select(func.min(EventLog.occurred_at), func.max(EventLog.occurred_at))).one()
    train = session.scalar(
        select(func.sum(func.extract("epoch", TrainingCycle.finished_at - TrainingCycle.started_at))).where(
            TrainingCycle.status == "succeeded"
        )
    )
    decided = select(type_coerce(GateDecision.created_at - TrainingCycle.finished_at, Interval)).join(
        TrainingCycle, TrainingCycle.checkpoint_id == GateDecision.candidate_id
    )
    gate = sum(float(d.total_seconds()) for d in session.scalars(decided))
    release = select(type_coerce(Promotion.created_at - GateDecision.created_at, Interval)).join(
        GateDecision, GateDecision.id == Promotion.gate_decision_id
    )
    evals = eval_seconds(session)
    return {
        "simulate": (last - first).total_seconds() if first and last else 0.0,
        "train": float(train or 0.0),
        "eval": evals,
        "gate": max(0.0, gate - evals),
        "release": sum(float(d.total_seconds()) for d in session.scalars(release)),
    }


def ab_from_store(session: Session, label: str) -> dict:
    """The stored ``flywheel ab`` result labelled ``label`` as its report (``metrics``, ``pairs``...).

    Raises:
        SystemExit: no comparison carries that label.
    """
    row = session.scalars(
        select(ABComparison).where(ABComparison.label == label).order_by(ABComparison.id.desc())
    ).first()
    if row is None:
        raise SystemExit(f"no stored A/B comparison labelled {label!r}")
    return {
        "final": row.checkpoint_id,
        "pairs": row.pairs,
        "tasks": row.tasks,
        "samples": row.samples,
        "lower_bound": row.pass_rate_lower_bound,
        "metrics": row.metrics,
        "errors": (row.detail or {}).get("error_count", 0),
    }


def ab_metrics(report: dict) -> tuple[dict, dict]:
    """``(in_distribution, signals_ab)`` of a stored A/B result (:func:`ab_from_store`)."""
    m = report["metrics"]
    pr = m["pass_rate"]
    in_dist = {
        "pairs": report["pairs"],
        "tasks": report["tasks"],
        "samples": report["samples"],
        "base": pr["base"],
        "final": pr["final"],
        "diff": pr["diff"],
        "ci": pr["ci"],
        "lower_bound": report["lower_bound"],
        "errors": report["errors"],
    }
    signals = {n: {k: m[n][k] for k in ("base", "final", "diff", "ci")} for n in SIGNALS if n in m}
    return in_dist, signals

"""The loop report: every number is read from the database and files the loop wrote.

Used by ``flywheel demo`` (terminal + HTML + PNG under ``$FLYWHEEL_HOME/reports/``) and
``flywheel report``. Pass-rate intervals are Wilson score intervals (Wilson 1927). Every gate
decision is reported with its outcome (pass, fail or insufficient_evidence) and, per gated suite,
its decision and power (``report.json``: ``gates``). The terminal tables are
:mod:`ops.report_terminal`'s.
"""

from __future__ import annotations

import html
import json
from dataclasses import asdict
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.intervals import error_bars, wilson_interval
from app.models import (
    AuditLog,
    Checkpoint,
    DeadLetter,
    EvalResult,
    EvalRun,
    EventLog,
    GateDecision,
    PrivacyTombstone,
    RewardLabel,
    Trajectory,
)
from app.models.checkpoints import CheckpointStatus
from evals.gate.models import Outcome
from evals.gate.passk import sampling_report
from ops.curves import collect_curves, curves_html, gate_view, render_curves_png
from ops.report_model import LoopReport, SuiteResult, fmt_counts, fmt_diff, fmt_power
from ops.report_terminal import render_curves_terminal, render_terminal


def _reason_text(reason: Any) -> str:
    """One gate reason as a release manager reads it: ``PASS``, ``FAIL``, ``INSUFFICIENT`` or, for an
    informational figure that decides nothing (the power check), ``INFO``, then its message."""
    if isinstance(reason, str):
        return reason
    if isinstance(reason, dict):
        msg = reason.get("message") or reason.get("reason") or fmt_counts({str(k): v for k, v in reason.items()})
        ok = reason.get("ok", reason.get("passed"))
        if reason.get("informational"):
            mark = "INFO"
        else:
            mark = "PASS" if ok else "-" if ok is None else "INSUFFICIENT" if reason.get("inconclusive") else "FAIL"
        return f"{mark}  {msg}"
    return str(reason)


def _gate_entry(decision: Any) -> dict[str, Any]:
    """One gate decision for ``LoopReport.gates`` (see there)."""
    stored = (decision.report or {}).get("suites") or {}
    view = gate_view(decision)
    keys = ("margin", "n_pairs", "diff", "diff_low", "diff_high")
    return {
        "decision_id": str(decision.id),
        "candidate_id": decision.candidate_id,
        "production_id": decision.production_id,
        "decision": view["decision"],
        "suites": {name: {**v, **{k: stored[name].get(k) for k in keys}} for name, v in view["suites"].items()},
    }


def count_multi_segment_sessions(session: Session) -> int:
    """Trajectories with more than one segment (sessions whose agent self-summarized)."""
    return session.scalar(select(func.count()).select_from(Trajectory).where(Trajectory.num_segments > 1)) or 0


def collect_report(session: Session, candidate_id: str | None = None) -> LoopReport:
    """Read the loop's state. ``candidate_id`` defaults to the newest trained checkpoint."""
    events = dict(session.execute(select(EventLog.type, func.count()).group_by(EventLog.type)).all())
    dead = dict(session.execute(select(DeadLetter.reason, func.count()).group_by(DeadLetter.reason)).all())
    dropped = session.scalar(select(func.coalesce(func.sum(PrivacyTombstone.events_dropped), 0))) or 0
    trajs = dict(session.execute(select(Trajectory.status, func.count()).group_by(Trajectory.status)).all())

    if candidate_id is None:
        candidate_id = session.scalar(
            select(Checkpoint.id).where(Checkpoint.parent_id.is_not(None)).order_by(Checkpoint.created_at.desc())
        )
    cand = session.get(Checkpoint, candidate_id) if candidate_id else None
    spec = (
        cand.reward_spec
        if cand and cand.reward_spec
        else session.scalar(select(RewardLabel.spec).order_by(RewardLabel.created_at.desc()))
    )
    rewards = (
        [float(r) for r in session.scalars(select(RewardLabel.reward).where(RewardLabel.spec == spec))] if spec else []
    )
    production = session.scalar(select(Checkpoint.id).where(Checkpoint.status == CheckpointStatus.PRODUCTION))

    report = LoopReport(
        generated_at=datetime.now(UTC).isoformat(timespec="seconds"),
        events_by_type=events,
        dead_letters_by_reason=dead,
        privacy_events_dropped=int(dropped),
        trajectories_by_status=trajs,
        multi_segment_sessions=count_multi_segment_sessions(session),
        reward_spec=spec,
        rewards=rewards,
        candidate_id=cand.id if cand else None,
        candidate_parent_id=cand.parent_id if cand else None,
        candidate_status=cand.status if cand else None,
        training_metrics=dict(cand.metrics or {}) if cand else {},
        trajectories_trained=cand.num_trajectories if cand else 0,
        production_id=production,
    )
    if cand is None:
        return report
    metrics_file = Path(cand.path) / "metrics.json"
    if metrics_file.exists():  # per-step curves live next to the checkpoint, written by the trainer
        history = json.loads(metrics_file.read_text()).get("history") or []
        report.training_history = [h for h in history if isinstance(h, dict)]

    decision = session.scalars(
        select(GateDecision).where(GateDecision.candidate_id == cand.id).order_by(GateDecision.created_at.desc())
    ).first()
    compared = [cand.id] + ([decision.production_id] if decision else ([cand.parent_id] if cand.parent_id else []))
    for ckpt in compared:
        runs = session.scalars(
            select(EvalRun).where(EvalRun.checkpoint_id == ckpt).order_by(EvalRun.started_at.desc())
        ).all()
        seen: set[str] = set()
        for run in runs:
            if run.suite in seen:
                continue
            seen.add(run.suite)
            rows = session.execute(
                select(
                    func.count(),
                    func.count().filter(EvalResult.passed),
                    func.coalesce(func.avg(EvalResult.completion_tokens), 0.0),
                    func.coalesce(func.sum(EvalResult.tool_call_errors), 0),
                ).where(EvalResult.run_id == run.id)
            ).one()
            total, passed, mean_tokens, errors = int(rows[0]), int(rows[1]), float(rows[2]), int(rows[3])
            if total == 0:  # an empty suite (e.g. mined before any task is mined) has no rate to show
                continue
            low, high = wilson_interval(passed, total)
            per_task = session.execute(
                select(EvalResult.task_id, func.count(), func.count().filter(EvalResult.passed))
                .where(EvalResult.run_id == run.id)
                .group_by(EvalResult.task_id)
            ).all()
            planned_k = int(((run.config or {}).get("suite") or {}).get("samples_per_task") or 0) or None
            samp = sampling_report([Outcome(t, i, i < c) for t, n, c in per_task for i in range(n)], planned_k)
            assert samp is not None  # total > 0: the run has outcomes
            report.suites.append(
                SuiteResult(
                    ckpt,
                    run.suite,
                    passed,
                    total,
                    low,
                    high,
                    mean_tokens,
                    errors,
                    samples_per_task=samp.samples_per_task,
                    pass_at_k=samp.pass_at_k,
                    best_of_k=samp.best_of_k,
                )
            )
    report.gates = [
        _gate_entry(d) for d in session.scalars(select(GateDecision).order_by(GateDecision.created_at, GateDecision.id))
    ]
    if decision is not None:
        report.gate_passed = decision.passed
        report.gate_decision = _gate_entry(decision)["decision"]
        report.gate_reasons = [_reason_text(r) for r in decision.reasons or []]
        report.gate_report_path = decision.report_path
    audit = session.scalars(select(AuditLog).order_by(AuditLog.id.desc()).limit(10)).all()
    report.audit = [
        {"at": a.created_at.isoformat(timespec="seconds"), "actor": a.actor, "action": a.action, "target": a.target}
        for a in audit
    ]
    return report


def _scalar_metrics(metrics: dict[str, Any]) -> dict[str, float]:
    out = {}
    for k, v in metrics.items():
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            out[k] = float(v)
    return out


def render_png(report: LoopReport, path: Path) -> Path:
    """Reward histogram, training metrics and pass rates with intervals, in one PNG."""
    matplotlib.use("Agg")

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    ax = axes[0]
    if report.rewards:
        ax.hist(report.rewards, bins=min(20, max(5, len(report.rewards) // 2)), color="#4C72B0")
    ax.set_title(f"rewards ({report.reward_spec or 'none'})")
    ax.set_xlabel("reward")
    ax = axes[1]
    curves = {
        name: [h[name] for h in report.training_history if isinstance(h.get(name), (int, float))]
        for name in ("loss", "entropy", "is_clip_frac", "kl")
    }
    curves = {k: v for k, v in curves.items() if v}
    for name, values in curves.items():
        ax.plot(range(1, len(values) + 1), values, marker="o", label=name)
    if curves:
        ax.legend(fontsize=8)
    ax.set_title("training (per step)")
    ax.set_xlabel("step")
    ax = axes[2]
    suites = sorted({s.suite for s in report.suites})
    ckpts = sorted({s.checkpoint_id for s in report.suites})
    width = 0.8 / max(1, len(ckpts))
    for i, ckpt in enumerate(ckpts):
        xs, ys, cis = [], [], []
        for j, suite in enumerate(suites):
            for s in report.suites:
                if s.suite == suite and s.checkpoint_id == ckpt:
                    xs.append(j + i * width)
                    ys.append(s.rate)
                    cis.append((s.low, s.high))
        bars = ax.bar(xs, ys, width=width, yerr=error_bars(ys, cis), capsize=4, label=ckpt)
        counts = [
            f"{s.passed}/{s.total}"
            for suite in suites
            for s in report.suites
            if s.suite == suite and s.checkpoint_id == ckpt
        ]
        ax.bar_label(bars, labels=counts, padding=2, fontsize=8)
    ax.set_xticks([j + width * (len(ckpts) - 1) / 2 for j in range(len(suites))], suites)
    ax.set_ylim(0, 1)
    ax.set_title("pass rate, 95% Wilson CI")
    if ckpts:
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def render_html(report: LoopReport, png_name: str, path: Path) -> Path:
    """A self-contained HTML page next to the PNG."""
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(s.suite)}</td><td>{e(s.checkpoint_id)}</td><td>{s.rate:.1%}</td>"
        f"<td>[{s.low:.1%}, {s.high:.1%}]</td><td>{s.total}</td><td>{e(s.pass_at_k_text)}</td>"
        f"<td>{s.mean_completion_tokens:.0f}</td></tr>"
        for s in sorted(report.suites, key=lambda s: (s.suite, s.checkpoint_id))
    )
    metrics = "".join(f"<li>{e(k)} = {v:.4g}</li>" for k, v in sorted(_scalar_metrics(report.training_metrics).items()))
    reasons = "".join(f"<li>{e(r)}</li>" for r in report.gate_reasons)
    events = "".join(f"<li>{e(k)}: {v}</li>" for k, v in sorted(report.events_by_type.items()))
    gate = report.gate_decision or "not decided"
    latest = next((g for g in reversed(report.gates) if g["candidate_id"] == report.candidate_id), None)
    gate_rows = "".join(
        f"<tr><td>{e(name)}</td><td>{e(s['decision'])}</td><td>{fmt_power(s['power'])}</td>"
        f"<td>{fmt_diff(s['diff'], s['diff_low'], s['diff_high'])}</td><td>{s['n_pairs'] or 0}</td></tr>"
        for name, s in (latest["suites"].items() if latest else [])
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>flywheel loop report</title>
<style>body{{font-family:system-ui,sans-serif;max-width:1100px;margin:2em auto}}td,th{{padding:4px 10px;border-bottom:1px solid #ddd}}</style>
</head><body><h1>flywheel loop report</h1><p>generated {e(report.generated_at)}</p>
<h2>events</h2><p>{report.total_events} stored; {sum(report.dead_letters_by_reason.values())} dead letters;
{report.privacy_events_dropped} privacy-mode events dropped</p><ul>{events}</ul>
<h2>trajectories</h2><p>{e(fmt_counts(report.trajectories_by_status))}; {report.multi_segment_sessions} with more than one segment; rewards ({e(str(report.reward_spec))}): n={len(report.rewards)}</p>
<h2>training</h2><p>candidate {e(str(report.candidate_id))} from {e(str(report.candidate_parent_id))},
{report.trajectories_trained} trajectories</p><ul>{metrics}</ul>
<h2>evals</h2><table><tr><th>suite</th><th>checkpoint</th><th>pass rate</th><th>95% CI</th><th>n</th><th>pass@k, best-of-K</th><th>mean tokens</th></tr>{rows}</table>
<h2>gate: {e(gate)}</h2>
<table><tr><th>gated suite</th><th>decision</th><th>power</th><th>difference [95% CI]</th><th>pairs</th></tr>{gate_rows}</table>
<ul>{reasons}</ul>
<h2>serving now: {e(str(report.production_id))}</h2>
<img src="{e(png_name)}" style="max-width:100%"></body></html>"""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page)
    return path


def write_report(session: Session, out_dir: Path, candidate_id: str | None = None) -> tuple[LoopReport, Path]:
    """Collect, print, and write ``report.html`` + ``report.png`` + ``curves.png`` + ``report.json``
    into ``out_dir``; the learning curve covers every checkpoint (``ops.curves``)."""
    report = collect_report(session, candidate_id)
    points = collect_curves(session)
    report.curves = [p.as_dict() for p in points]
    render_terminal(report)
    render_curves_terminal(points)
    render_png(report, out_dir / "report.png")
    render_curves_png(points, out_dir / "curves.png")
    html_path = render_html(report, "report.png", out_dir / "report.html")
    html_path.write_text(
        html_path.read_text().replace("</body></html>", curves_html(points, "curves.png") + "</body></html>")
    )

    (out_dir / "report.json").write_text(json.dumps(asdict(report), indent=2, default=str))
    return report, html_path

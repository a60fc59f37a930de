"""Learning curves across cycles: held-out pass rates and product signals per checkpoint.

Invariant: every point is read from the database (eval results, finalized trajectories and their
reward labels), never from a process's memory, so the curve of a resumed or repeated demo is the
curve of what the loop stored. Points follow the checkpoints in creation order: base, then each
cycle's candidate (promoted or not), so a rejected candidate shows where it would have led.

Eval side (per suite, the checkpoint's newest succeeded run): pass@1 = passed / results with a
Wilson 95 % interval (Wilson 1927), the invalid tool-call rate (tool-call errors / tool calls) and
the mean completion tokens per session. Product side (finalized trajectories the checkpoint served,
``trajectory.checkpoint_id``): the online signals of :mod:`app.lifecycle.online` (mean reward, edit
acceptance, edit persistence, dissatisfied follow-ups per session, latency per token) with their 95 %
intervals clustered by user (delta method, ``app.lifecycle.online.signal_summary``), sessions and
mean completion tokens. Gate side: the checkpoint's latest gate decision as a candidate (pass, fail
or insufficient_evidence) with each gated suite's decision and power. The terminal tables live in
:mod:`ops.report_terminal`.
"""

from __future__ import annotations

import html
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.intervals import error_bars, wilson_interval
from app.lifecycle.online import load_sessions, signal_summary
from app.lifecycle.online_stats import SIGNALS as ONLINE
from app.models import Checkpoint, EvalResult, EvalRun, GateDecision
from app.models.checkpoints import GateVerdict

SIGNALS = (
    "mean_reward",
    "edit_acceptance",
    "edit_persistence",
    "dissatisfied_followup_rate",
    "latency_per_token",
    "mean_completion_tokens",
)


@dataclass
class CurvePoint:
    """One checkpoint on the curve.

    Attributes:
        suites: suite -> ``{"pass_rate", "low", "high", "n", "invalid_tool_call_rate",
            "mean_completion_tokens"}`` (rates in [0, 1], tokens per session).
        signals: product signals of the sessions it served (see the module docstring); empty when
            it served none.
        signal_ci: signal -> ``[low, high]``, its 95 % interval clustered by user (only signals
            with at least two users).
        gate: its latest gate decision as a candidate, ``{"decision", "suites": {suite:
            {"decision", "power"}}}`` over the gated suites; empty when it was never gated.
    """

    checkpoint_id: str
    generation: int
    status: str
    parent_id: str | None
    invert_reward: bool = False
    suites: dict[str, dict[str, float]] = field(default_factory=dict)
    signals: dict[str, float] = field(default_factory=dict)
    signal_ci: dict[str, list[float]] = field(default_factory=dict)
    gate: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _suite_points(session: Session, checkpoint_id: str) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    runs = session.scalars(
        select(EvalRun)
        .where(EvalRun.checkpoint_id == checkpoint_id, EvalRun.status == "succeeded")
        .order_by(EvalRun.started_at.desc())
    ).all()
    for run in runs:
        if run.suite in out:
            continue
        n, passed, tokens, calls, errors = session.execute(
            select(
                func.count(),
                func.count().filter(EvalResult.passed),
                func.coalesce(func.avg(EvalResult.completion_tokens), 0.0),
                func.coalesce(func.sum(EvalResult.tool_calls), 0),
                func.coalesce(func.sum(EvalResult.tool_call_errors), 0),
            ).where(EvalResult.run_id == run.id)
        ).one()
        if not n:
            continue
        low, high = wilson_interval(int(passed), int(n))
        out[run.suite] = {
            "pass_rate": passed / n,
            "low": low,
            "high": high,
            "n": int(n),
            "invalid_tool_call_rate": errors / calls if calls else 0.0,
            "mean_completion_tokens": float(tokens),
        }
    return out


def product_signals(session: Session, checkpoint_id: str) -> dict[str, float]:
    """Product signals of the finalized sessions ``checkpoint_id`` served: each online signal of
    :mod:`app.lifecycle.online_stats` as its ratio of sums (the canary policy's point estimate), plus
    ``sessions`` and ``mean_completion_tokens``; a signal with no denominator is left out; empty when
    the checkpoint served no session."""
    return _signals_with_ci(session, checkpoint_id)[0]


def _signals_with_ci(session: Session, checkpoint_id: str) -> tuple[dict[str, float], dict[str, list[float]]]:
    """:func:`product_signals` and each signal's 95 % interval clustered by user."""
    rows = [signals for _, signals in load_sessions(session, checkpoint_id)]
    if not rows:
        return {}, {}
    out = {"sessions": float(len(rows)), "mean_completion_tokens": sum(r.completion_tokens for r in rows) / len(rows)}
    for name in ONLINE:
        num, den = (sum(v) for v in zip(*(r.parts(name) for r in rows)))
        if den > 0:
            out[name] = num / den
    summary = signal_summary(rows)["signals"]
    ci = {k: [v["low"], v["high"]] for k, v in summary.items() if v is not None and k in out}
    return out, ci


def gate_view(decision: Any) -> dict[str, Any]:
    """``{"decision", "suites": {suite: {"decision", "power"}}}`` of a stored ``gate_decision`` row
    over its gated suites (a decision stored before the three-way gate reads as pass or fail, power
    None)."""
    report = decision.report or {}
    suites = {
        name: {
            "decision": s.get("decision") or (GateVerdict.PASS if s.get("passed") else GateVerdict.FAIL),
            "power": s.get("power"),
        }
        for name, s in sorted((report.get("suites") or {}).items())
        if s.get("gated", True)
    }
    return {
        "decision": report.get("decision") or (GateVerdict.PASS if decision.passed else GateVerdict.FAIL),
        "suites": suites,
    }


def _latest_gate(session: Session, checkpoint_id: str) -> dict[str, Any]:
    row = session.scalars(
        select(GateDecision)
        .where(GateDecision.candidate_id == checkpoint_id)
        .order_by(GateDecision.created_at.desc(), GateDecision.id.desc())
        .limit(1)
    ).first()
    return gate_view(row) if row is not None else {}


def collect_curves(session: Session) -> list[CurvePoint]:
    """One :class:`CurvePoint` per registered checkpoint, oldest first."""
    points = []
    for ckpt in session.scalars(select(Checkpoint).order_by(Checkpoint.generation, Checkpoint.created_at)):
        signals, ci = _signals_with_ci(session, ckpt.id)
        points.append(
            CurvePoint(
                checkpoint_id=ckpt.id,
                generation=ckpt.generation,
                status=ckpt.status,
                parent_id=ckpt.parent_id,
                invert_reward=bool((ckpt.metrics or {}).get("invert_reward")),
                suites=_suite_points(session, ckpt.id),
                signals=signals,
                signal_ci=ci,
                gate=_latest_gate(session, ckpt.id),
            )
        )
    return points


def signal_moves(points: list[CurvePoint]) -> dict[str, tuple[float, float]]:
    """``signal -> (first, last)`` over the checkpoints that served sessions (the lineage's ends)."""
    served = [p for p in points if p.signals]
    if len(served) < 2:
        return {}
    first, last = served[0].signals, served[-1].signals
    return {k: (first[k], last[k]) for k in SIGNALS if k in first and k in last}


DECISION_MARK: dict[str, str] = {
    GateVerdict.PASS: "pass",
    GateVerdict.FAIL: "fail",
    GateVerdict.INSUFFICIENT_EVIDENCE: "insuff.",
}


def render_curves_png(points: list[CurvePoint], path: Path) -> Path:
    """Held-out pass rate per suite and the product signals across checkpoints, every point with its
    95 % interval bar (Wilson for pass rates, clustered by user for signals); under each checkpoint
    its gate decision."""
    matplotlib.use("Agg", force=True)

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.6))
    labels = [
        f"g{p.generation}{'*' if p.invert_reward else ''}"
        + (f"\n{DECISION_MARK.get(p.gate['decision'], p.gate['decision'])}" if p.gate else "")
        for p in points
    ]
    xs = list(range(len(points)))
    ax = axes[0]
    for suite in sorted({s for p in points for s in p.suites}):
        pts = [(x, p.suites[suite]) for x, p in zip(xs, points) if suite in p.suites]
        values = [s["pass_rate"] for _, s in pts]
        ax.errorbar(
            [x for x, _ in pts],
            values,
            capsize=3,
            marker="o",
            label=suite,
            yerr=error_bars(values, [[s["low"], s["high"]] for _, s in pts]),
        )
    ax.set_title("held-out pass@1 (95% Wilson)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key in ("edit_acceptance", "edit_persistence", "dissatisfied_followup_rate"):  # rates in [0, 1]
        signal_pts = [(x, p.signals[key], p.signal_ci.get(key)) for x, p in zip(xs, points) if key in p.signals]
        values = [v for _, v, _ in signal_pts]
        ax.errorbar(
            [x for x, _, _ in signal_pts],
            values,
            yerr=error_bars(values, [ci for *_, ci in signal_pts]),
            capsize=3,
            marker="o",
            label=key,
        )
    ax.set_title("product signals of served sessions (95% CI by user)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[2]
    reward_pts = [
        (x, p.signals["mean_reward"], p.signal_ci.get("mean_reward"))
        for x, p in zip(xs, points)
        if "mean_reward" in p.signals
    ]
    values = [v for _, v, _ in reward_pts]
    ax.errorbar(
        [x for x, _, _ in reward_pts],
        values,
        yerr=error_bars(values, [ci for *_, ci in reward_pts]),
        capsize=3,
        marker="o",
        color="tab:green",
    )
    ax.set_title("mean reward of served sessions (95% CI by user)")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("checkpoint generation (* = planted regression), gate decision")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt_suite(s: dict[str, float] | None) -> str:
    return "-" if not s else f"{s['pass_rate']:.0%} [{s['low']:.0%}, {s['high']:.0%}] n={s['n']}"


def _fmt_signal(p: CurvePoint, key: str) -> str:
    if key not in p.signals:
        return "-"
    ci = p.signal_ci.get(key)
    return f"{p.signals[key]:.3f}" + (f" [{ci[0]:.3f}, {ci[1]:.3f}]" if ci else "")


def _fmt_gate(p: CurvePoint) -> str:
    if not p.gate:
        return "-"
    powers = ", ".join(
        f"{name} {s['decision']} (power {'-' if s['power'] is None else format(s['power'], '.2f')})"
        for name, s in p.gate["suites"].items()
    )
    return f"{p.gate['decision']}: {powers}"


def curves_html(points: list[CurvePoint], png_name: str) -> str:
    """An HTML section (table + PNG) of the learning curve: pass rates and signals with their 95 %
    intervals, and each checkpoint's gate decision with every gated suite's decision and power."""
    suites = sorted({s for p in points for s in p.suites})
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("gen", "checkpoint", "status", "gate", *suites, *SIGNALS))
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                p.generation,
                p.checkpoint_id + (" (inverted reward)" if p.invert_reward else ""),
                p.status,
                _fmt_gate(p),
                *(_fmt_suite(p.suites.get(s)) for s in suites),
                *(_fmt_signal(p, k) for k in SIGNALS),
            )
        )
        + "</tr>"
        for p in points
    )
    return (
        f"<h2>learning curve</h2><table><tr>{head}</tr>{rows}</table>"
        f'<img src="{html.escape(png_name)}" style="max-width:100%">'
    )

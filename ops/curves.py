"""Learning curves across cycles: held-out pass rates and product signals per checkpoint.

Invariant: every point is read from the database (eval results, finalized trajectories and their
reward labels), never from a process's memory, so the curve of a resumed or repeated demo is the
curve of what the loop stored. Points follow the checkpoints in creation order: base, then each
cycle's candidate (promoted or not), so a rejected candidate shows where it would have led.

Eval side (per suite, the checkpoint's newest succeeded run): pass@1 = passed / results with a
Wilson 95 % interval (Wilson 1927), the invalid tool-call rate (tool-call errors / tool calls) and
the mean completion tokens per session. Product side (finalized trajectories the checkpoint served,
``trajectory.checkpoint_id``): the online signals of :mod:`app.promotion.online` (mean reward, edit
acceptance, edit persistence, dissatisfied follow-ups per session, latency per token), sessions and
mean completion tokens.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.intervals import wilson_interval

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
    """

    checkpoint_id: str
    generation: int
    status: str
    parent_id: str | None
    invert_reward: bool = False
    suites: dict[str, dict[str, float]] = field(default_factory=dict)
    signals: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _suite_points(session: Session, checkpoint_id: str) -> dict[str, dict[str, float]]:
    from app.models import EvalResult, EvalRun

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
    :mod:`app.promotion.online_stats` as its ratio of sums (the canary policy's point estimate), plus
    ``sessions`` and ``mean_completion_tokens``; a signal with no denominator is left out; empty when
    the checkpoint served no session."""
    from app.promotion.online import load_sessions
    from app.promotion.online_stats import SIGNALS as ONLINE

    rows = [signals for _, signals in load_sessions(session, checkpoint_id)]
    if not rows:
        return {}
    out = {"sessions": float(len(rows)), "mean_completion_tokens": sum(r.completion_tokens for r in rows) / len(rows)}
    for name in ONLINE:
        num, den = (sum(v) for v in zip(*(r.parts(name) for r in rows)))
        if den > 0:
            out[name] = num / den
    return out


def collect_curves(session: Session) -> list[CurvePoint]:
    """One :class:`CurvePoint` per registered checkpoint, oldest first."""
    from app.models import Checkpoint

    points = []
    for ckpt in session.scalars(select(Checkpoint).order_by(Checkpoint.generation, Checkpoint.created_at)):
        points.append(
            CurvePoint(
                checkpoint_id=ckpt.id,
                generation=ckpt.generation,
                status=ckpt.status,
                parent_id=ckpt.parent_id,
                invert_reward=bool((ckpt.metrics or {}).get("invert_reward")),
                suites=_suite_points(session, ckpt.id),
                signals=product_signals(session, ckpt.id),
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


def render_curves_png(points: list[CurvePoint], path: Path) -> Path:
    """Held-out pass rate per suite (with 95 % intervals) and the product signals across checkpoints."""
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    labels = [f"g{p.generation}{'*' if p.invert_reward else ''}" for p in points]
    xs = list(range(len(points)))
    ax = axes[0]
    for suite in sorted({s for p in points for s in p.suites}):
        pts = [(x, p.suites[suite]) for x, p in zip(xs, points) if suite in p.suites]
        ax.errorbar(
            [x for x, _ in pts],
            [s["pass_rate"] for _, s in pts],
            capsize=3,
            marker="o",
            label=suite,
            yerr=[[s["pass_rate"] - s["low"] for _, s in pts], [s["high"] - s["pass_rate"] for _, s in pts]],
        )
    ax.set_title("held-out pass@1 (95% Wilson)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[1]
    for key in ("edit_acceptance", "edit_persistence", "dissatisfied_followup_rate"):  # rates in [0, 1]
        pts = [(x, p.signals[key]) for x, p in zip(xs, points) if key in p.signals]
        ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", label=key)
    ax.set_title("product signals of served sessions")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=8)
    ax = axes[2]
    pts = [(x, p.signals["mean_reward"]) for x, p in zip(xs, points) if "mean_reward" in p.signals]
    ax.plot([x for x, _ in pts], [v for _, v in pts], marker="o", color="tab:green")
    ax.set_title("mean reward of served sessions")
    for ax in axes:
        ax.set_xticks(xs, labels)
        ax.set_xlabel("checkpoint generation (* = planted regression)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def _fmt_suite(s: dict[str, float] | None) -> str:
    return "-" if not s else f"{s['pass_rate']:.0%} [{s['low']:.0%}, {s['high']:.0%}] n={s['n']}"


def render_curves_terminal(points: list[CurvePoint]) -> None:
    """The learning curve as a rich table, then which way each product signal moved."""
    from rich.console import Console
    from rich.table import Table

    suites = sorted({s for p in points for s in p.suites})
    table = Table(
        "gen",
        "checkpoint",
        "status",
        *suites,
        "sessions",
        "reward",
        "accept",
        "persist",
        "dissat.",
        "tokens",
        title="learning curve (held-out pass@1, 95% Wilson; signals of served sessions)",
    )
    for p in points:
        sig = p.signals
        table.add_row(
            str(p.generation),
            p.checkpoint_id + (" (inverted reward)" if p.invert_reward else ""),
            p.status,
            *(_fmt_suite(p.suites.get(s)) for s in suites),
            str(sig.get("sessions", 0)),
            *(f"{sig[k]:.2f}" if k in sig else "-" for k in SIGNALS),
        )
    con = Console()
    con.print(table)
    for key, (first, last) in signal_moves(points).items():
        arrow = "up" if last > first else "down" if last < first else "unchanged"
        con.print(f"  {key}: {first:.3f} -> {last:.3f} ({arrow})")


def curves_html(points: list[CurvePoint], png_name: str) -> str:
    """An HTML section (table + PNG) of the learning curve."""
    import html

    suites = sorted({s for p in points for s in p.suites})
    head = "".join(f"<th>{html.escape(h)}</th>" for h in ("gen", "checkpoint", "status", *suites, *SIGNALS))
    rows = "".join(
        "<tr>"
        + "".join(
            f"<td>{html.escape(str(v))}</td>"
            for v in (
                p.generation,
                p.checkpoint_id + (" (inverted reward)" if p.invert_reward else ""),
                p.status,
                *(_fmt_suite(p.suites.get(s)) for s in suites),
                *(f"{p.signals[k]:.3f}" if k in p.signals else "-" for k in SIGNALS),
            )
        )
        + "</tr>"
        for p in points
    )
    return (
        f"<h2>learning curve</h2><table><tr>{head}</tr>{rows}</table>"
        f'<img src="{html.escape(png_name)}" style="max-width:100%">'
    )

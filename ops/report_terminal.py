"""The loop report and the learning curve as terminal tables that fit 80 columns.

Invariant: no name is cut. Checkpoint ids (``ckpt-YYYYmmddHHMMSS-xxxxxx``, 26 characters) stand in
the tables as short labels (``cand``/``prod`` in the loop report, ``#0``, ``#1``, ... on the curve)
explained by a legend above each table; suite names, statuses and gate decisions are columns that
never wrap, and the numbers are split over several narrow tables instead of one wide one, so at 80
columns rich never has to shorten a name with an ellipsis (``tests/unit/test_report_terminal.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.console import Console
from rich.table import Table

from app.models.checkpoints import GateVerdict
from ops.curves import SIGNALS, signal_moves
from ops.report_model import LoopReport, fmt_counts, fmt_diff, fmt_power

if TYPE_CHECKING:
    from ops.curves import CurvePoint

DECISION_STYLE: dict[str, str] = {
    GateVerdict.PASS: "green",
    GateVerdict.FAIL: "red",
    GateVerdict.INSUFFICIENT_EVIDENCE: "yellow",
}
SIGNAL_HEADS = {
    "mean_reward": "reward",
    "edit_acceptance": "accept",
    "edit_persistence": "persist",
    "dissatisfied_followup_rate": "dissat.",
    "latency_per_token": "s/tok",
    "mean_completion_tokens": "tokens",
}


def _table(title: str, *names: str, columns: tuple[str, ...] = ()) -> Table:
    """A compact table (no vertical rules); the ``names`` columns hold names and never wrap."""
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left")
    for col in columns:
        t.add_column(col, no_wrap=col in names)
    return t


def _decision(text: str | None) -> str:
    return "-" if not text else f"[{DECISION_STYLE.get(text, 'white')}]{text}[/]"


def render_terminal(report: "LoopReport", console: Console | None = None) -> None:
    """Print the loop report: counts, the candidate, held-out evals and its gate decision."""
    con = console or Console()
    con.rule("[bold]flywheel loop report")
    con.print(
        f"events stored: [bold]{report.total_events}[/]  "
        + ", ".join(f"{k} {v}" for k, v in sorted(report.events_by_type.items()))
    )
    con.print(
        f"dead letters: {sum(report.dead_letters_by_reason.values())}"
        + (f" ({fmt_counts(report.dead_letters_by_reason)})" if report.dead_letters_by_reason else "")
        + f"  privacy-mode events dropped: {report.privacy_events_dropped}"
    )
    con.print(
        "trajectories: "
        + fmt_counts(report.trajectories_by_status)
        + f"; {report.multi_segment_sessions} with more than one segment (self-summarized)"
    )
    if report.rewards:
        r = sorted(report.rewards)
        con.print(
            f"rewards ({report.reward_spec}): n={len(r)} mean={sum(r) / len(r):+.3f} min={r[0]:+.3f} "
            f"median={r[len(r) // 2]:+.3f} max={r[-1]:+.3f}"
        )
    if report.candidate_id:
        con.print(
            f"candidate [bold]{report.candidate_id}[/] (parent {report.candidate_parent_id}, "
            f"{report.trajectories_trained} trajectories, status {report.candidate_status})"
        )
        metrics = {k: v for k, v in report.training_metrics.items() if isinstance(v, int | float)}
        if metrics:
            con.print("training: " + ", ".join(f"{k}={v:.4g}" for k, v in sorted(metrics.items())))
    labels = {report.candidate_id: "cand"} if report.candidate_id else {}
    for s in report.suites:
        labels.setdefault(s.checkpoint_id, "prod" if "prod" not in labels.values() else f"c{len(labels)}")
    if report.suites:
        con.print("checkpoints: " + "; ".join(f"{v} = {k}" for k, v in labels.items()))
        t = _table(
            "held-out evals (95% Wilson interval)",
            "suite",
            "ckpt",
            "pass rate",
            "95% CI",
            columns=("suite", "ckpt", "pass rate", "95% CI", "n", "tokens", "tool err"),
        )
        rows = sorted(report.suites, key=lambda s: (s.suite, labels[s.checkpoint_id] != "prod"))
        for s in rows:
            t.add_row(
                s.suite,
                labels[s.checkpoint_id],
                f"{s.rate:.1%}",
                f"[{s.low:.1%}, {s.high:.1%}]",
                str(s.total),
                f"{s.mean_completion_tokens:.0f}",
                str(s.tool_call_errors),
            )
        con.print(t)
        if any(s.samples_per_task > 1 for s in rows):
            t = _table(
                "pass@k (unbiased, Chen et al. 2021) and best-of-K",
                "suite",
                "ckpt",
                columns=("suite", "ckpt", "pass@k, best-of-K"),
            )
            for s in rows:
                t.add_row(s.suite, labels[s.checkpoint_id], s.pass_at_k_text)
            con.print(t)
    if report.gate_decision is not None:
        latest = next((g for g in reversed(report.gates) if g["candidate_id"] == report.candidate_id), None)
        con.print(f"gate: {_decision(report.gate_decision)}")
        if latest and latest["suites"]:
            t = _table(
                "gated suites: decision, power at the margin (points), candidate - production",
                "suite",
                "decision",
                "diff pt [95% CI]",
                columns=("suite", "decision", "power", "margin", "diff pt [95% CI]"),
            )
            for name, s in latest["suites"].items():
                t.add_row(
                    name,
                    _decision(s["decision"]),
                    fmt_power(s["power"]),
                    "-" if s["margin"] is None else f"{100 * s['margin']:.1f}",
                    fmt_diff(s["diff"], s["diff_low"], s["diff_high"]).replace(" pt", ""),
                )
            con.print(t)
        for reason in report.gate_reasons:
            con.print(f"  - {reason}", highlight=False)
    con.print(f"serving now (production): [bold]{report.production_id}[/]")


def render_curves_terminal(points: list["CurvePoint"], console: Console | None = None) -> None:
    """The learning curve: a legend of the checkpoints with their gate decision, held-out pass@1
    per checkpoint and suite with the gate's per-suite decision and power, the signals of the
    sessions each served, then which way each signal moved."""
    con = console or Console()
    label = {p.checkpoint_id: f"#{i}{'*' if p.invert_reward else ''}" for i, p in enumerate(points)}
    t = _table(
        "learning curve: checkpoints (* = planted regression, inverted reward)",
        "#",
        "checkpoint",
        "status",
        "gate",
        columns=("#", "gen", "checkpoint", "status", "gate"),
    )
    for p in points:
        t.add_row(
            label[p.checkpoint_id], str(p.generation), p.checkpoint_id, p.status, _decision(p.gate.get("decision"))
        )
    con.print(t)
    t = _table(
        "held-out pass@1 (95% Wilson) and the gate per suite",
        "#",
        "suite",
        "gate",
        columns=("#", "suite", "pass@1 [95% CI]", "n", "gate", "power"),
    )
    for p in points:
        for suite, s in sorted(p.suites.items()):
            g = p.gate.get("suites", {}).get(suite, {})
            t.add_row(
                label[p.checkpoint_id],
                suite,
                f"{s['pass_rate']:.0%} [{s['low']:.0%}, {s['high']:.0%}]",
                str(s["n"]),
                _decision(g.get("decision")),
                fmt_power(g.get("power")),
            )
    con.print(t)
    served = [p for p in points if p.signals]
    if served:
        t = _table(
            "signals of the sessions each checkpoint served",
            "#",
            columns=("#", "sessions", *(SIGNAL_HEADS[k] for k in SIGNALS)),
        )
        for p in served:
            sig = p.signals
            t.add_row(
                label[p.checkpoint_id],
                str(int(sig.get("sessions", 0))),
                *(f"{sig[k]:.2f}" if k in sig else "-" for k in SIGNALS),
            )
        con.print(t)
    for key, (first, last) in signal_moves(points).items():
        arrow = "up" if last > first else "down" if last < first else "unchanged"
        con.print(f"  {key}: {first:.3f} -> {last:.3f} ({arrow})")

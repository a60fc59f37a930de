"""The demo's report: the loop report (``ops.report``) plus the served checkpoint's fresh-traffic
curve, one point per cycle from ``flywheel ab`` (pass rate and product signals with their 95 %
intervals, task-clustered), in the terminal, as PNG and in the HTML report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import matplotlib
import matplotlib.pyplot as plt
from rich.console import Console
from rich.table import Table

from app.core.db import session_scope
from ops.report import write_report

CURVE_SIGNALS = ("edit_persistence", "dissatisfied_followup_rate", "mean_completion_tokens")


def curve_point(cycle: int, ab: dict) -> dict[str, Any]:
    """One curve entry from a ``flywheel ab --json`` result: the served checkpoint's fresh-traffic
    pass rate and product signals with their 95 % intervals, and the difference from base."""
    m = ab["metrics"]
    return {
        "cycle": cycle,
        "checkpoint_id": ab["final"],
        "pairs": ab["pairs"],
        "pass_rate": m["pass_rate"]["final"],
        "pass_rate_ci": m["pass_rate"]["final_ci"],
        "diff_vs_base": m["pass_rate"]["diff"],
        "diff_vs_base_ci": m["pass_rate"]["ci"],
        "signals": {k: {"value": m[k]["final"], "ci": m[k]["final_ci"]} for k in CURVE_SIGNALS if k in m},
    }


def curve_conclusion(curve: list[dict[str, Any]]) -> str:
    """What the curve lets a reader conclude, in words (and the bigger command when it is too small)."""
    if not curve:
        return "no checkpoint was measured on fresh traffic."
    last = curve[-1]
    ci = last.get("diff_vs_base_ci")
    if last["checkpoint_id"] == curve[0]["checkpoint_id"] and all(
        p["checkpoint_id"] == last["checkpoint_id"] for p in curve
    ):
        verdict = f"production stayed {last['checkpoint_id']}: no candidate earned promotion in this run."
    elif ci and ci[0] > 0:
        verdict = (
            f"{last['checkpoint_id']} beats base on fresh traffic (difference interval {ci[0]:+.0%} to {ci[1]:+.0%})."
        )
    elif ci and ci[1] < 0:
        verdict = f"{last['checkpoint_id']} is worse than base on fresh traffic ({ci[0]:+.0%} to {ci[1]:+.0%})."
    else:
        verdict = f"{last['checkpoint_id']} cannot be told apart from base on {last['pairs']} fresh sessions."
    return (
        verdict + " This run is too small to conclude whether the loop improves production: "
        "`python bench/flywheel.py` (4 cycles, 31-51 minutes on 2 CPU cores) is sized to show it "
        "(docs/benchmarks.md#flywheel)."
    )


def render_curve_png(curve: list[dict[str, Any]], path: Path) -> Path:
    """The fresh-traffic curve: per cycle, the served checkpoint's hidden-test pass rate and product
    signals, each with its 95 % interval bar (task-clustered, ``ops.ab``)."""
    matplotlib.use("Agg")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [p["cycle"] for p in curve]
    labels = [f"{p['cycle']}\n{p['checkpoint_id'][-6:]}" for p in curve]

    def bars(ax, values, cis, label):
        # a signal undefined in a cycle (no edit to persist, fewer than two tasks) has no point
        pts = [(c, v, ci) for c, v, ci in zip(x, values, cis) if v is not None]
        if not pts:
            return
        xs, vs, intervals = zip(*pts)
        lo = [max(0.0, v - ci[0]) if ci else 0 for v, ci in zip(vs, intervals)]
        hi = [max(0.0, ci[1] - v) if ci else 0 for v, ci in zip(vs, intervals)]
        ax.errorbar(xs, vs, yerr=[lo, hi], marker="o", capsize=4, label=label)

    bars(axes[0], [p["pass_rate"] for p in curve], [p["pass_rate_ci"] for p in curve], "hidden-test pass rate")
    axes[0].set_title("served checkpoint on fresh traffic: pass rate (95 % CI)")
    for name in ("edit_persistence", "dissatisfied_followup_rate"):
        sig = [p["signals"].get(name, {}) for p in curve]
        bars(axes[1], [s.get("value") for s in sig], [s.get("ci") for s in sig], name)
    axes[1].set_title("product signals (95 % CI)")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.set_xticks(x, labels)
        ax.set_xlabel("cycle / serving checkpoint")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_curve_terminal(curve: list[dict[str, Any]], conclusion: str) -> None:
    """The fresh-traffic curve as an 80-column table, one row per cycle, then the conclusion."""

    def pct(v, ci=None) -> str:
        if v is None:
            return "-"
        return f"{v:.0%}" + (f" [{ci[0]:.0%},{ci[1]:.0%}]" if ci else "")

    table = Table(title="served checkpoint on fresh traffic (95 % intervals)", title_justify="left")
    for col in ("cycle", "serving", "pass rate", "persist", "follow-up", "tokens"):
        table.add_column(col, overflow="fold")
    for p in curve:
        sig = p["signals"]
        table.add_row(
            str(p["cycle"]),
            p["checkpoint_id"],
            pct(p["pass_rate"], p["pass_rate_ci"]),
            pct(sig.get("edit_persistence", {}).get("value")),
            pct(sig.get("dissatisfied_followup_rate", {}).get("value")),
            f"{sig.get('mean_completion_tokens', {}).get('value') or 0:.0f}",
        )
    con = Console(width=80)
    con.print(table)
    con.print(conclusion)


def write_demo_report(out: Path, last_candidate: str | None, curve: list[dict[str, Any]]) -> Path:
    """Terminal report plus HTML and PNG under ``out``, with the fresh-traffic curve. Returns the
    HTML report's path."""
    last = last_candidate
    with session_scope() as session:
        _, html_path = write_report(session, out, last)
    report = json.loads((out / "report.json").read_text())
    report["curve"] = curve
    report["curve_conclusion"] = curve_conclusion(curve)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    render_curve_terminal(curve, report["curve_conclusion"])
    if curve:
        render_curve_png(curve, out / "fresh_traffic.png")
        html_path.write_text(
            html_path.read_text().replace(
                "</body></html>",
                '<h2>The served checkpoint on fresh traffic</h2><img src="fresh_traffic.png">'
                f"<p>{report['curve_conclusion']}</p></body></html>",
            )
        )
    return html_path

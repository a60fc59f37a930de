"""``flywheel gate``'s explanation of a decision, in tables that fit an 80-column terminal.

Invariant: suite names, decisions and intervals never wrap or shorten; what would not fit beside
them goes into the next table (tests/unit/test_gate_terminal.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich import box
from rich.table import Table

from app.models.checkpoints import GateVerdict
from evals.gate.passk import format_sampling

if TYPE_CHECKING:
    from rich.console import Console

    from evals.gate.models import PassRate
    from evals.gating import GateOutcome

STYLE = {
    GateVerdict.PASS: "green",
    GateVerdict.FAIL: "red",
    GateVerdict.INSUFFICIENT_EVIDENCE: "yellow",
    GateVerdict.NOT_GATED: "dim",
}


def _table(title: str, *columns: str, names: tuple[str, ...] = ("suite",)) -> Table:
    t = Table(title=title, box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1, 0, 0), title_justify="left")
    for col in columns:
        t.add_column(col, no_wrap=col in names)
    return t


def explain(console: "Console", outcome: "GateOutcome") -> None:
    """Print a gate outcome in tables that fit 80 columns (suite names whole): pass rates, then each
    suite's decision with its power and the paired difference, pass@k when a suite sampled more than
    once, every reason, the decision and where the report is."""

    def fmt(p: PassRate | None) -> str:
        return f"{p.rate:.1%} [{p.low:.0%}, {p.high:.0%}]" if p else "-"

    r = outcome.result
    rates = _table(
        f"gate {outcome.candidate_id} vs {outcome.production_id}: pass rates (95% Wilson); new +/-: tasks newly solved / newly broken",
        "suite",
        "tasks x k",
        "candidate",
        "production",
        "new +/-",
        names=("suite", "candidate", "production"),
    )
    verdicts = {
        gated: _table(
            ("gated suites" if gated else "reported, not gating")
            + ": decision, power to tell a margin-worse candidate, difference in points",
            "suite",
            "decision",
            "power",
            "margin",
            "diff [CI]",
            names=("suite", "decision", "diff [CI]"),
        )
        for gated in (True, False)
    }
    k = _table("pass@k and best-of-K (unbiased pass@k, Chen et al. 2021)", "suite", "side", "pass@k, best-of-K")
    for s in r.suites.values():
        rates.add_row(
            s.suite,
            f"{s.n_tasks} x {s.samples_per_task}",
            fmt(s.candidate),
            fmt(s.production),
            f"{len(s.newly_solved)} / {len(s.newly_broken)}",
        )
        verdicts[s.gated].add_row(
            s.suite,
            f"[{STYLE[s.decision]}]{s.decision}[/]",
            "-" if s.power is None else f"{s.power:.2f}",
            "-" if s.margin is None else f"{100 * s.margin:.1f}",
            "-"
            if s.diff is None or s.diff_low is None or s.diff_high is None
            else f"{100 * s.diff:+.1f} [{100 * s.diff_low:+.1f}, {100 * s.diff_high:+.1f}]",
        )
        for side, samp in (("candidate", s.candidate_sampling), ("production", s.production_sampling)):
            k.add_row(s.suite, side, format_sampling(samp))
    console.print(rates)
    for t in verdicts.values():
        if t.row_count:
            console.print(t)
    if any(s.samples_per_task > 1 for s in r.suites.values()):
        console.print(k)
    for reason in r.reasons:
        if reason.informational:
            mark = "[dim]·[/dim]"
        elif reason.passed:
            mark = "[green]✓[/green]"
        elif not reason.gated:
            mark = "[yellow]·[/yellow]"
        else:
            mark = "[yellow]?[/yellow]" if reason.inconclusive else "[red]✗[/red]"
        console.print(f" {mark} {reason.message}", highlight=False)
    verdict = f"[bold {STYLE[r.decision]}]{r.decision.upper().replace('_', ' ')}[/]"
    console.print(
        f"gate {verdict} → checkpoint {outcome.candidate_id} is now "
        f"{'gate_passed' if r.passed else 'gate_failed'}; decision {outcome.decision_id}"
    )
    if r.decision == GateVerdict.INSUFFICIENT_EVIDENCE:
        console.print(
            "not promotable as it stands: a release manager may promote it with a written "
            "override_reason (POST /v1/promotions; audited)"
        )
    console.print(f"report: {outcome.report_path}/report.json, gate.png, tasks.md")

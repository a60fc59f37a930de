"""Gate reports: ``report.json``, ``gate.png`` and ``tasks.md`` under ``<reports>/gates/<decision_id>/``.

Invariant: a report is derived only from the :class:`~evals.gate.models.GateResult` (plus ids), so the
stored ``gate_decision.report`` and the files on disk say the same thing. Files are written to a
temporary name and renamed, so a reader never sees a half-written report.
"""

from __future__ import annotations

import json
import os
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from app.core.intervals import error_bars
from app.core.settings import get_settings
from app.models.checkpoints import GateVerdict
from evals.gate.models import GateResult, SamplingReport
from evals.gate.passk import format_sampling

MAX_LISTED = 200
DECISION_COLORS = {
    GateVerdict.PASS: "tab:green",
    GateVerdict.FAIL: "tab:red",
    GateVerdict.INSUFFICIENT_EVIDENCE: "tab:orange",
    GateVerdict.NOT_GATED: "tab:gray",
}


def report_dict(
    decision_id: str,
    candidate_id: str,
    production_id: str,
    result: GateResult,
    run_ids: dict[str, dict[str, str]] | None = None,
) -> dict[str, Any]:
    """The JSON report: decision, every reason, per-suite statistics, per-task diff, config."""
    diff = {
        name: {
            "newly_solved": s.newly_solved[:MAX_LISTED],
            "newly_broken": s.newly_broken[:MAX_LISTED],
            "truncated": max(len(s.newly_solved), len(s.newly_broken)) > MAX_LISTED,
        }
        for name, s in result.suites.items()
    }
    return {
        "decision_id": decision_id,
        "candidate_id": candidate_id,
        "production_id": production_id,
        "passed": result.passed,
        "decision": result.decision,
        "created_at": datetime.now(UTC).isoformat(),
        "failures": [r.message for r in result.failures()],
        "reasons": [r.model_dump(mode="json") for r in result.reasons],
        "suites": {
            n: s.model_dump(mode="json", exclude={"newly_solved", "newly_broken"}) for n, s in result.suites.items()
        },
        "task_diff": diff,
        "runs": run_ids or {},
        "config": result.config,
    }


def _atomic_write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def render_png(result: GateResult, path: Path, title: str) -> Path:
    """Two panels: per-suite pass rates with 95 % Wilson intervals (candidate vs production, with
    the paired difference's interval annotated), and each monitor's use of its allowance
    (drift / allowed drift; > 1 is a breach)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    suites = [s for s in result.suites.values() if s.candidate and s.production]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(12, 4.8), gridspec_kw={"width_ratios": [1, 1.2]})
    fig.suptitle(
        f"{title}  {result.decision.upper().replace('_', ' ')}",
        color=DECISION_COLORS[result.decision],
        fontsize=11,
    )
    x = np.arange(len(suites))
    for off, role, color in ((-0.18, "candidate", "tab:blue"), (0.18, "production", "tab:gray")):
        rates = [getattr(s, role) for s in suites]
        vals = np.array([r.rate for r in rates])
        err = error_bars([r.rate for r in rates], [(r.low, r.high) for r in rates])
        ax1.bar(x + off, vals, width=0.36, color=color, alpha=0.8, label=role)
        if len(rates):  # the marker keeps a 0 % rate visible
            ax1.errorbar(x + off, vals, yerr=err, fmt="o", color="black", markersize=4, capsize=4)
    for i, s in enumerate(suites):
        power = "-" if s.power is None else f"{s.power:.2f}"
        ax1.annotate(
            f"Δ {s.diff:+.1%}\n[{s.diff_low:+.1%}, {s.diff_high:+.1%}]\n{s.decision}, power {power}",
            (i, 1.02),
            ha="center",
            va="bottom",
            fontsize=8,
            color=DECISION_COLORS[s.decision],
            xycoords=("data", "axes fraction"),
        )
    ax1.set_xticks(x, [f"{s.suite}\n({s.n_tasks} tasks x {s.samples_per_task})" for s in suites])
    ax1.set_ylim(0, 1)
    ax1.set_ylabel("pass rate")
    ax1.legend(loc="upper right", fontsize=8)
    ax1.set_title("pass rate, 95% Wilson CI; Δ = paired difference CI", fontsize=9, pad=40)
    labels, used, observed, colors = [], [], [], []
    for s in suites:
        for m in s.monitors:
            drift = m.candidate - m.production if m.worse == "increase" else m.production - m.candidate
            # The bar is what decided (the drift's lower confidence bound under the significant
            # rule, else the drift); the dot is the observed drift.
            decisive = drift if m.drift_low is None else m.drift_low
            if m.allowed_drift:
                u, o = decisive / m.allowed_drift, drift / m.allowed_drift
            elif m.limit:
                u = o = m.candidate / m.limit if m.worse == "increase" else m.limit / max(m.candidate, 1e-9)
            else:
                u = o = 0.0
            labels.append(f"{s.suite}: {m.metric}\n{m.production:.3g} → {m.candidate:.3g}")
            used.append(max(-1.5, min(2.5, u)))
            observed.append(max(-1.5, min(2.5, o)))
            colors.append("tab:green" if m.passed else "tab:red")
    y = np.arange(len(labels))
    ax2.barh(y, used, color=colors)
    if len(y):
        ax2.plot(observed, y, "o", color="black", markersize=3, label="observed drift")
        ax2.legend(loc="lower right", fontsize=7)
    ax2.set_xlim(min([-0.25, *used, *observed]) - 0.1, max([1.25, *used, *observed]) + 0.1)
    ax2.axvline(1.0, color="tab:red", linestyle="--", linewidth=1)
    ax2.axvline(0.0, color="black", linewidth=0.5)
    ax2.set_yticks(y, labels, fontsize=7)
    ax2.invert_yaxis()
    ax2.set_xlabel("bad-direction drift / allowed (> 1 breaches; bar: what decided, dot: observed)", fontsize=8)
    ax2.set_title("behaviour monitors (production → candidate)", fontsize=9)
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp.png")
    fig.savefig(tmp, dpi=110)
    plt.close(fig)
    os.replace(tmp, path)
    return path


def render_task_diff(report: dict[str, Any]) -> str:
    """Markdown list of newly solved and newly broken tasks per suite."""
    lines = [
        f"# Gate {report['decision_id']}: {report['candidate_id']} vs {report['production_id']} "
        f"— {report.get('decision', 'pass' if report['passed'] else 'fail')}",
        "",
    ]
    for f in report["failures"]:
        lines.append(f"- NOT PASSED: {f}")
    for name, d in sorted(report["task_diff"].items()):
        lines += ["", f"## {name}", ""]
        suite = report["suites"].get(name, {})
        if suite.get("power") is not None:
            stop = suite.get("stopped_at_pairs")
            lines.append(
                f"- decision: {suite['decision']}, power {suite['power']:.2f} at margin {suite['margin']:.1%}"
                + ("" if stop is None else f", decided at {stop} pairs")
            )
        for role in ("candidate", "production"):
            samp = suite.get(f"{role}_sampling")
            if samp:
                lines.append(
                    f"- {role}: {format_sampling(SamplingReport.model_validate(samp))} "
                    f"({samp['n_tasks']} tasks x {samp['samples_per_task']} samples)"
                )
        lines += ["", f"Newly broken ({len(d['newly_broken'])}):"]
        lines += [f"- {t}" for t in d["newly_broken"]] or ["- none"]
        lines += ["", f"Newly solved ({len(d['newly_solved'])}):"]
        lines += [f"- {t}" for t in d["newly_solved"]] or ["- none"]
        if d["truncated"]:
            lines.append(f"(lists truncated at {MAX_LISTED})")
    return "\n".join(lines) + "\n"


def write_report(
    decision_id: str,
    candidate_id: str,
    production_id: str,
    result: GateResult,
    run_ids: dict[str, dict[str, str]] | None = None,
    out_dir: Path | None = None,
) -> tuple[dict[str, Any], Path]:
    """Write ``report.json``, ``gate.png`` and ``tasks.md`` for one decision.

    Args:
        out_dir: default ``<settings.store.reports()>/gates/<decision_id>/``.

    Returns:
        (the report dict, stored in ``gate_decision.report``; the report directory).
    """
    if out_dir is None:
        out_dir = get_settings().store.reports() / "gates" / decision_id
    out_dir.mkdir(parents=True, exist_ok=True)
    report = report_dict(decision_id, candidate_id, production_id, result, run_ids)
    render_png(result, out_dir / "gate.png", f"gate {candidate_id} vs {production_id}")
    _atomic_write(out_dir / "tasks.md", render_task_diff(report).encode())
    report["files"] = {"json": "report.json", "png": "gate.png", "task_diff": "tasks.md"}
    _atomic_write(out_dir / "report.json", json.dumps(report, indent=2, sort_keys=True).encode())
    return report, out_dir

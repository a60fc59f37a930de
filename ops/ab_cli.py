"""``flywheel ab BASE FINAL``: the paired A/B on fresh production traffic (heavy imports stay inside the command).

It lives in ``ops`` beside the simulator, not in ``evals``: it composes the eval harness with the
simulated developers of ``ops.developer``, and ``evals`` sits below ``ops`` (pyproject's layers).
"""

from __future__ import annotations

import json

import typer
from rich.console import Console
from rich.table import Table

from ops.simulator_cli import parse_mix


def _check_label(value: str | None) -> str | None:
    """A label the ``ab_comparison.label`` column stores: 1 to 128 characters, no NUL."""
    if value is not None and not (0 < len(value) <= 128 and "\x00" not in value):
        raise typer.BadParameter("a label has 1 to 128 characters and no NUL")
    return value


def ab(
    base: str = typer.Argument(..., help="the baseline checkpoint, e.g. base"),
    final: str = typer.Argument(..., help="the checkpoint compared with it"),
    split: str = typer.Option(
        "fresh",
        "--split",
        help="fresh: kinds of request never trained on nor held out, at production difficulty (default); "
        "fresh_hard: such kinds that base rarely solves; "
        "test_params: the older draw, unseen parameters of the training templates",
    ),
    tasks: int = typer.Option(
        None, "--tasks", min=2, help="tasks drawn with the mix (default: every task at the mix's levels)"
    ),
    samples: int = typer.Option(4, "--samples", min=1, max=64, help="sessions per task and arm"),
    difficulty_mix: str = typer.Option(
        None,
        "--difficulty-mix",
        help="LEVEL:WEIGHT pairs (default: the production mix '1:0.6,2:0.3,3:0.1'; 'none': every level alike)",
    ),
    cluster_by: str = typer.Option(
        "template", "--cluster-by", help="the intervals' cluster: template (default) or task"
    ),
    max_turns: int = typer.Option(6, "--max-turns", min=1, help="model turns per session"),
    max_tokens: int = typer.Option(1024, "--max-tokens", min=16, help="completion tokens per session"),
    max_tokens_per_turn: int = typer.Option(256, "--max-tokens-per-turn", min=8),
    temperature: float = typer.Option(0.7, "--temperature", help="the serving temperature"),
    seed: int = typer.Option(0, "--seed", help="seeds the task draw, sampling and the developers"),
    workers: int = typer.Option(None, "--workers", "-w", min=1, help="sessions in flight per arm"),
    label: str = typer.Option(
        None, "--label", callback=_check_label, help="names this result on the dashboard's curve, e.g. cycle-2"
    ),
    record: bool = typer.Option(
        True, "--record/--no-record", help="store the result in the database (the dashboard's curve)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the comparison as one JSON line"),
) -> None:
    """Serve the same fresh requests (new kinds of request at the production mix, or with --split
    test_params unseen parameters of the training templates) with BASE and FINAL on the eval engine,
    let seeded simulated developers answer both, and compare pass rate and product signals with
    template-clustered 95 % intervals. Nothing reaches the event stream. The result is written as a
    JSON report and, unless --no-record, as one ``ab_comparison`` row (one transaction)."""
    if split not in ("fresh", "fresh_hard", "test_params"):
        raise typer.BadParameter("fresh, fresh_hard or test_params", param_hint="--split")
    if cluster_by not in ("template", "task"):
        raise typer.BadParameter("template or task", param_hint="--cluster-by")
    from app.core.db import database_url, session_scope
    from app.core.settings import get_settings
    from app.core.telemetry import configure_telemetry
    from app.repositories.ab_comparisons import record_ab_comparison
    from ops.ab import ABConfig, run_ab

    if record:
        database_url()  # no database configured: fail now, not after the A/B
    configure_telemetry("flywheel-ab")
    console = Console(stderr=as_json)
    mix = (
        {}
        if difficulty_mix is None
        else {"difficulty_mix": None if difficulty_mix == "none" else parse_mix(difficulty_mix)}
    )
    config = ABConfig(
        split=split,
        tasks=tasks,
        samples=samples,
        cluster_by=cluster_by,
        **mix,
        max_turns=max_turns,
        max_tokens=max_tokens,
        max_tokens_per_turn=max_tokens_per_turn,
        temperature=temperature,
        seed=seed,
        workers=workers,
    )
    done = [0]

    def progress(session) -> None:
        done[0] += 1
        if done[0] % 25 == 0:
            console.print(f"  {session.checkpoint_id}: {done[0]} sessions served", highlight=False)

    report = run_ab(base, final, config, on_session=progress)
    out = get_settings().store.reports() / "ab"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{base}-vs-{final}-{config.fingerprint()}.json"
    path.write_text(json.dumps(report, indent=2))
    comparison_id = None
    if record:
        with session_scope() as session:
            comparison_id = record_ab_comparison(session, report, label=label, report_path=str(path)).id
    if as_json:
        typer.echo(json.dumps({**report, "report_path": str(path), "comparison_id": comparison_id}))
        return
    console.print(_table(report))
    for e in report["errors"][:10]:
        console.print(f"[red]error[/red] {e}", highlight=False)
    console.print(f"report: {path}" + (f" (ab_comparison {comparison_id})" if comparison_id else ""))


def _table(report: dict):
    def num(v, pct: bool) -> str:
        return "-" if v is None else (f"{v:.1%}" if pct else f"{v:.3g}")

    t = Table(
        title=f"A/B {report['final']} vs {report['base']}: {report['pairs']} pairs on {report['tasks']} tasks "
        f"({report['split']}), intervals clustered by {report.get('cluster_by', 'task')}"
    )
    for col in ("metric", "base", "final", "diff", f"{report['confidence']:.0%} CI of diff"):
        t.add_column(col)
    for name, m in report["metrics"].items():
        pct = name in ("pass_rate", "edit_acceptance", "edit_persistence", "dissatisfied_followup_rate")
        ci = m["ci"]
        t.add_row(
            name,
            num(m["base"], pct),
            num(m["final"], pct),
            "-" if m["diff"] is None else (f"{m['diff']:+.1%}" if pct else f"{m['diff']:+.3g}"),
            "-" if ci is None else f"[{num(ci[0], pct)}, {num(ci[1], pct)}]",
        )
    return t


def register(app: typer.Typer) -> None:
    """Add this module's command to the main app."""
    app.command("ab")(ab)

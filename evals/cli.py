"""CLI commands of this package (registered on the main ``flywheel`` app). Import heavy modules
inside the command functions, never at module level.

``flywheel eval CHECKPOINT --suite NAME`` runs a suite (``eval`` is a group whose default command is
``run``, so ``flywheel eval contamination`` / ``mine`` / ``suites`` are subcommands);
``flywheel gate CANDIDATE`` evaluates and decides; ``flywheel eval floors`` derives the gate's floors
from a checkpoint's stored results (:mod:`evals.floors_cli`).
"""

from __future__ import annotations

import json
from pathlib import Path

import typer
from rich.console import Console, Group
from rich.table import Table
from typer._click.core import Context as ClickContext  # the click typer vendors: its groups take this
from typer.core import TyperGroup

from evals import environment_cli, floors_cli


class _DefaultRunGroup(TyperGroup):
    """A group that treats an unknown first word as the argument of its ``run`` command."""

    def parse_args(self, ctx: ClickContext, args: list[str]) -> list[str]:
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


eval_app = typer.Typer(
    cls=_DefaultRunGroup,
    no_args_is_help=True,
    help="Run eval suites (flywheel eval CHECKPOINT --suite NAME), mine tasks, check contamination.",
)

LIMIT = typer.Option(None, "--limit", "-n", min=1, help="seeded subset of N tasks (changes the suite fingerprint)")
WORKERS = typer.Option(
    None, "--workers", "-w", min=1, help="concurrent sessions (default: 64 with vLLM or the reference engine, else 1)"
)
eval_app.command("floors")(floors_cli.eval_floors)

MAX_TURNS = typer.Option(None, "--max-turns", min=1, help="override the suite's turn budget")
MAX_TOKENS = typer.Option(None, "--max-tokens", min=1, help="override completion tokens per turn")
JSON = typer.Option(False, "--json", help="print the result as JSON")
SAMPLES = typer.Option(
    None,
    "--samples",
    "-k",
    min=1,
    max=64,
    help="override samples per task (smoke runs; the gate was sized for the suite's own)",
)


def _overrides(max_turns: int | None, max_tokens: int | None, samples: int | None = None) -> dict[str, int]:
    return {
        k: v
        for k, v in (("max_turns", max_turns), ("max_tokens_per_turn", max_tokens), ("samples_per_task", samples))
        if v is not None
    }


@eval_app.command("run")
def eval_run(
    checkpoint: str = typer.Argument(..., help="checkpoint id, e.g. base"),
    suite: list[str] = typer.Option(..., "--suite", "-s", help="suite name (repeatable)"),
    limit: int | None = LIMIT,
    workers: int | None = WORKERS,
    max_turns: int | None = MAX_TURNS,
    max_tokens: int | None = MAX_TOKENS,
    samples: int | None = SAMPLES,
    force: bool = typer.Option(False, help="re-run even if a succeeded run of this plan exists"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON line per suite"),
) -> None:
    """Run SUITE against CHECKPOINT in the agent harness; resumes an interrupted run of the same plan."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from app.core.telemetry import configure_telemetry
    from evals.config import load_suite
    from evals.runner import run_suite

    configure_telemetry("flywheel-evals")
    console = Console(stderr=as_json)
    summaries = []
    for name in suite:
        cfg = load_suite(name).with_overrides(limit=limit, **_overrides(max_turns, max_tokens, samples))
        with Progress(
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[rate]}"),
            TimeElapsedColumn(),
            console=console,
            transient=as_json,
        ) as progress:
            bar = progress.add_task(f"{checkpoint} · {name}", total=None, rate="")
            passed = [0, 0]

            def on_plan(plan, todo, bar=bar):
                progress.update(bar, total=len(plan.planned), completed=len(plan.planned) - todo)

            def on_result(task_id, sample, fields, bar=bar, passed=passed):
                passed[0] += bool(fields["passed"])
                passed[1] += 1
                progress.update(bar, advance=1, rate=f"{passed[0]}/{passed[1]} passed this session")

            summaries.append(
                run_suite(checkpoint, cfg, workers=workers, force=force, on_plan=on_plan, on_result=on_result)
            )
    if as_json:
        for s in summaries:
            typer.echo(json.dumps(s.as_dict(), default=str))
    else:
        console.print(_runs_table(summaries))
    if any(s.status != "succeeded" for s in summaries):
        for s in summaries:
            for e in s.errors:
                console.print(f"[red]error[/red] {s.suite}: {e}")
        raise typer.Exit(1)


def _runs_table(summaries):
    from evals.gate.passk import format_pass_at_k

    t = Table(title="eval runs")
    for col in ("suite", "checkpoint", "status", "done", "pass rate", "95% CI", "pass@k, best-of-K", "sessions"):
        t.add_column(col, justify="right" if col in ("done", "pass rate") else "left", overflow="fold")
    b = Table(title="behaviour")
    for col in ("suite", "checkpoint", "tool-call errors", "asked", "edited", "tokens", "latency s"):
        b.add_column(col, overflow="fold")
    for s in summaries:
        m = s.monitors or {}
        t.add_row(
            s.suite,
            s.checkpoint_id,
            s.status,
            f"{s.done}/{s.planned}",
            f"{s.pass_rate:.1%}",
            f"[{s.low:.1%}, {s.high:.1%}]",
            format_pass_at_k(s.pass_at_k, s.samples_per_task, s.best_of_k),
            "cached run" if s.cached else f"{s.ran} ran, {s.reused} reused",
        )
        b.add_row(
            s.suite,
            s.checkpoint_id,
            f"{m.get('invalid_tool_call_rate', 0):.1%}",
            f"{m.get('clarifying_question_rate', 0):.1%}",
            f"{m.get('edit_rate', 0):.1%}",
            f"{m.get('mean_completion_tokens', 0):.0f}",
            f"{m.get('mean_latency_s', 0):.1f}",
        )
    return Group(t, b, *(f"{s.suite}: run {s.run_id}, suite version {s.suite_version}" for s in summaries))


@eval_app.command("suites")
def eval_suites(as_json: bool = JSON) -> None:
    """List the shipped suites and whether the gate uses them (--json: one object per suite and line)."""
    from evals.config import list_suites, load_suite
    from evals.gate.policy import load_gate_config

    gate = load_gate_config()
    if as_json:
        for name in list_suites():
            s = load_suite(name)
            row = {"suite": name, "gated": name in gate.gated_suites(), "margin": gate.for_suite(name).margin}
            typer.echo(json.dumps({**row, "config": s.model_dump(mode="json")}))
        return
    t = Table(title="eval suites")
    for col in (
        "suite",
        "version",
        "source",
        "split",
        "samples",
        "temperature",
        "limit",
        "turns",
        "tokens",
        "gated",
        "margin",
    ):
        t.add_column(col)
    for name in list_suites():
        s = load_suite(name)
        t.add_row(
            name,
            s.version,
            s.source,
            s.split,
            str(s.samples_per_task),
            f"{s.sampling.temperature:g}",
            str(s.limit or "all"),
            str(s.budget.max_turns),
            str(s.budget.max_completion_tokens),
            "yes" if name in gate.gated_suites() else "no",
            f"{gate.for_suite(name).margin:.1%}",
        )
    Console().print(t)


@eval_app.command("mine")
def eval_mine(
    min_persistence: float = typer.Option(0.8, min=0.0, max=1.0, help="mean fraction of accepted edits still present"),
    limit: int | None = typer.Option(None, min=1, help="most trajectories to examine"),
    as_json: bool = JSON,
) -> None:
    """Mine held-out eval tasks from finalized production trajectories (and reserve them)."""
    from app.core.db import session_scope
    from evals.mined import mine_tasks

    with session_scope() as session:
        report = mine_tasks(session, min_persistence=min_persistence, limit=limit)
    if as_json:
        summary = {"examined": report.examined, "mined": len(report.mined)}
        typer.echo(
            json.dumps(
                {**summary, "reserved_trajectories": report.reserved_trajectories, "skipped": dict(report.skipped)}
            )
        )
        return
    typer.echo(
        f"examined {report.examined} trajectories, mined {len(report.mined)} tasks, reserved "
        f"{report.reserved_trajectories} more trajectories"
    )
    for reason, n in sorted(report.skipped.items()):
        typer.echo(f"  skipped {n:5d}  {reason}")


@eval_app.command("contamination")
def eval_contamination(
    static: bool = typer.Option(
        True,
        "--static/--no-static",
        help="also check the shipped suites' task ids (functions held-out "
        "and unseen-parameter, DataFrameBench test, HumanEval)",
    ),
    as_json: bool = JSON,
) -> None:
    """Verify no eval task appears in any checkpoint's training lineage or manifest; exit 1 if one does."""
    from app.core.db import session_scope
    from evals.mined import find_contamination

    extra: list[str] = []
    if static:
        from evals.config import load_suite
        from evals.plan import load_suite_tasks

        for name in ("functions", "functions_params", "dataframebench", "humaneval"):
            extra += [t.id for t in load_suite_tasks(load_suite(name))]
    with session_scope() as session:
        found = find_contamination(session, extra)
    if as_json:
        rows = [{"checkpoint_id": c.checkpoint_id, "task_id": c.task_id, "via": c.via} for c in found]
        typer.echo(json.dumps({"clean": not found, "static_task_ids": len(extra), "contaminated": rows}))
        raise typer.Exit(1 if found else 0)
    if not found:
        typer.secho(
            f"clean: no eval task in any checkpoint's training data ({len(extra)} static task ids checked "
            "plus every mined task)",
            fg="green",
        )
        return
    for c in found:
        typer.secho(f"CONTAMINATED {c.checkpoint_id}: {c.task_id} (via {c.via})", fg="red")
    raise typer.Exit(1)


def gate_cmd(
    candidate: str = typer.Argument(..., help="candidate checkpoint id"),
    production: str | None = typer.Option(None, "--production", help="baseline (default: production)"),
    suite: list[str] | None = typer.Option(None, "--suite", "-s", help="suites to run (default: gated ones)"),
    limit: int | None = LIMIT,
    workers: int | None = WORKERS,
    max_turns: int | None = MAX_TURNS,
    max_tokens: int | None = MAX_TOKENS,
    samples: int | None = SAMPLES,
    config: Path | None = typer.Option(
        None, "--config", exists=True, dir_okay=False, help="gate policy TOML (default evals/gate.toml)"
    ),
    min_pairs: int | None = typer.Option(
        None,
        "--min-pairs",
        min=1,
        help="override every suite's minimum paired outcomes and drop its floor (smoke runs)",
    ),
    gate_on: list[str] | None = typer.Option(
        None, "--gate-on", help="decide on these suites only (others reported; stored with the decision)"
    ),
    strict: bool = typer.Option(
        False, "--strict", hidden=True, help="accepted for old scripts: the gate exits 1 unless it passes anyway"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the decision as one JSON line"),
) -> None:
    """Evaluate CANDIDATE and production on every gated suite (reusing cached runs), decide and explain.
    Exits 0 when the gate passes, 1 when it fails or finds insufficient evidence."""
    from app.core.telemetry import configure_telemetry
    from evals.gate.policy import load_gate_config
    from evals.gating import gate_candidate

    configure_telemetry("flywheel-evals")
    console = Console(stderr=as_json)

    def on_run(name, role, s):
        how = "cached" if s.cached else f"ran {s.ran}, reused {s.reused}"
        console.print(f"  {name:<15} {role:<10} {s.checkpoint_id}: {s.passed}/{s.done} passed ({how})")

    console.print(f"gating [bold]{candidate}[/bold]")
    policy = load_gate_config(config).with_min_pairs(min_pairs).gating_only(gate_on or None)
    outcome = gate_candidate(
        candidate,
        production_id=production,
        config=policy,
        suites=suite or None,
        limit=limit,
        overrides=_overrides(max_turns, max_tokens, samples),
        workers=workers,
        on_run=on_run,
    )
    from evals.gate_terminal import explain

    explain(console, outcome)
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "decision_id": outcome.decision_id,
                    "candidate_id": candidate,
                    "production_id": outcome.production_id,
                    "passed": outcome.result.passed,
                    "decision": outcome.result.decision,
                    "power": {n: x.power for n, x in outcome.result.suites.items() if x.gated},
                    "failures": [r.message for r in outcome.result.failures()],
                    "sampling": {
                        n: {
                            "samples_per_task": x.samples_per_task,
                            "candidate": x.candidate_sampling and x.candidate_sampling.model_dump(),
                            "production": x.production_sampling and x.production_sampling.model_dump(),
                        }
                        for n, x in outcome.result.suites.items()
                    },
                    "report_path": outcome.report_path,
                }
            )
        )
    if not outcome.result.passed:
        raise typer.Exit(1)


@eval_app.command("sandbox-check")
def eval_sandbox_check(as_json: bool = JSON) -> None:
    """Whether this process can grade: bubblewrap builds the sandbox here (exit 0) or not (exit 1, with
    what to grant). A grading container's readiness probe; `flywheel worker` runs it at start."""
    from evals.harness.sandbox_preflight import sandbox_preflight

    result = sandbox_preflight()
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "ready": result.ready,
                    "unisolated": result.unisolated,
                    "reason": result.reason,
                    "containment": result.containment,
                }
            )
        )
    else:
        typer.echo(result.message(), err=not result.ready)
    raise typer.Exit(0 if result.ready else 1)


def register(app: typer.Typer) -> None:
    """Add this package's commands to the main app."""
    app.add_typer(eval_app, name="eval")
    app.command("gate")(gate_cmd)
    environment_cli.register(app)

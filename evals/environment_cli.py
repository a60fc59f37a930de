"""``flywheel tasks setup-envs``: give tasks environments proposed by the production model, verified in
the sandbox, cached in ``task_environment``; prints the counts, the success rate and one JSON line."""

from __future__ import annotations

import json
from pathlib import Path

import typer

tasks_app = typer.Typer(no_args_is_help=True, help="Task environments: proposed by the model, verified, cached.")


@tasks_app.command("setup-envs")
def setup_envs(
    source: str = typer.Option("mined", "--source", help="task source (mined: the eval_task table)"),
    split: str = typer.Option("test", "--split", help="split of a static source"),
    limit: int | None = typer.Option(None, "--limit", "-n", min=1, help="seeded subset of N tasks"),
    seed: int = typer.Option(0, "--seed", help="seed of the subset"),
    model_dir: Path | None = typer.Option(None, "--model-dir", help="propose with this HF folder (reference engine)"),
    checkpoint: str | None = typer.Option(None, "--checkpoint", help="checkpoint id (default: production)"),
    engine_kind: str | None = typer.Option(
        None, "--engine", help="vllm | reference (default: FLYWHEEL_SERVING_ENGINE)"
    ),
    max_tokens: int = typer.Option(256, "--max-tokens", min=16, help="completion tokens of one proposal"),
    policy_path: Path | None = typer.Option(
        None, "--policy", exists=True, dir_okay=False, help="allowed list TOML (default evals/environments.toml)"
    ),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="one line per task"),
    as_json: bool = typer.Option(False, "--json", help="print only the final JSON line"),
) -> None:
    """Propose an environment for every task without a verified one (production model, greedy), verify
    it on the reference solution, fall back to the task's imports when refused; report the success rate."""
    from app.core.db import session_scope
    from evals.environment_setup import setup_environments
    from evals.environments import load_policy
    from evals.tasks import load_tasks
    from evals.tasks.mined import MINED_SUITE
    from serving.engine import setup_engine

    policy = load_policy(policy_path)
    if source == MINED_SUITE:  # every mined task, not only those with a verified environment yet
        from evals.tasks.mined import load_mined_tasks

        with session_scope() as session:
            tasks = load_mined_tasks(session, limit=limit, seed=seed, verified_only=False)
    else:
        tasks = load_tasks(source, split, limit=limit, seed=seed)
    engine = setup_engine(checkpoint_id=checkpoint, model_dir=model_dir, engine=engine_kind)
    try:
        with session_scope() as session:
            report = setup_environments(session, tasks, engine, policy, max_tokens=max_tokens)
    finally:
        engine.close()
    result = json.dumps({"checkpoint_id": engine.checkpoint_id, "source": source, **report.as_dict()})
    if as_json:
        typer.echo(result)
        return
    rate = "n/a" if report.success_rate is None else f"{report.success_rate:.1%}"
    typer.echo(
        f"{report.tasks} tasks: {report.cached} cached, {report.proposed} proposed by {engine.checkpoint_id}, "
        f"{report.parsed} parsed, {report.verified} verified (success rate {rate}); {report.fallbacks} fell back "
        f"to the import resolver, {report.fallback_verified} of them verified; {report.unverified} unverified"
    )
    for reason, n in sorted(report.reasons.items()):
        typer.echo(f"  fell back {n:5d}  {reason}")
    if verbose:
        for o in report.outcomes:
            state = "verified" if o["verified"] else "UNVERIFIED"
            typer.echo(f"  {o['task_id']:<32} {o['origin']:<8} {state:<10} {o['reason'] or ''}")
    typer.echo(result)


def register(app: typer.Typer) -> None:
    """Add ``flywheel tasks`` to the main app."""
    app.add_typer(tasks_app, name="tasks")

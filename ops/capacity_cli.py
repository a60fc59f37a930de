"""``flywheel capacity``: the fleet a traffic needs, from the measured capacity model (``ops.capacity``)."""

from __future__ import annotations

import json
from dataclasses import asdict

import typer

from ops.capacity import MEASURED, plan


def capacity_cmd(
    sessions_per_day: int = typer.Option(..., "--sessions-per-day", min=1, help="product sessions a day"),
    sources: bool = typer.Option(False, "--sources", help="also list each measured cost and where it comes from"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object: the rows and the measured costs"),
) -> None:
    """Consumers, Kafka partitions, Postgres CPU/WAL/size, archive bytes, trainer GPUs and eval workers
    for a traffic, from costs measured on this project (docs/operations.md, Capacity)."""
    rows = plan(sessions_per_day)
    if as_json:
        costs = {name: asdict(c) for name, c in MEASURED.items()}
        typer.echo(
            json.dumps({"sessions_per_day": sessions_per_day, "rows": [asdict(r) for r in rows], "costs": costs})
        )
        return
    width = max(len(f"{r.component} {r.quantity}") for r in rows)
    typer.echo(f"capacity for {sessions_per_day:,} sessions a day")
    for r in rows:
        typer.echo(f"{r.component + ' ' + r.quantity:<{width}}  {r.value:>16}  {r.basis}")
    if sources:
        for name, c in MEASURED.items():
            typer.echo(f"{name}: {c.value:g} {c.unit} ({c.source})")


def register(app: typer.Typer) -> None:
    app.command("capacity")(capacity_cmd)

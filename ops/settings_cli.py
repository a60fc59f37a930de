"""``flywheel settings``: the reference of every ``FLYWHEEL_*`` setting, generated from the settings
classes (``ops.settings_reference``); ``--markdown`` is docs/settings.md."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import typer


def settings_cmd(
    markdown: bool = typer.Option(False, "--markdown", help="print docs/settings.md as the code generates it"),
    as_json: bool = typer.Option(False, "--json", help="one JSON object per setting and line"),
    check: Path | None = typer.Option(
        None, "--check", dir_okay=False, help="exit 1 when this file differs from the generated reference"
    ),
) -> None:
    """Every FLYWHEEL_* setting with its type, default and meaning (from the settings classes)."""
    from rich.console import Console
    from rich.table import Table

    from ops.settings_reference import render_markdown, setting_docs

    if check is not None:
        current = check.read_text() if check.exists() else ""
        if current != render_markdown():
            typer.secho(f"{check} is out of date: flywheel settings --markdown > {check}", fg="red", err=True)
            raise typer.Exit(1)
        typer.echo(f"{check} matches the settings classes")
        return
    if markdown:
        typer.echo(render_markdown(), nl=False)
        return
    docs = setting_docs()
    if as_json:
        for doc in docs:
            typer.echo(json.dumps(dataclasses.asdict(doc)))
        return
    table = Table("variable", "type", "default", "meaning")
    for doc in docs:
        table.add_row(doc.variable, doc.type.replace("\\|", "|"), doc.default.strip("`"), doc.meaning)
    Console().print(table)


def register(app: typer.Typer) -> None:
    """Add ``settings`` to the main app."""
    app.command("settings")(settings_cmd)

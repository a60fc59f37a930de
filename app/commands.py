"""``flywheel db`` (migrations) and ``flywheel events`` (the event contract's JSON Schema)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")
events_app = typer.Typer(no_args_is_help=True, help="The event contract.")
JSON = typer.Option(False, "--json", help="print the result as one JSON object")


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="target revision"), as_json: bool = JSON) -> None:
    """Migrate the configured database (FLYWHEEL_DATABASE_URL or the local stack) to REVISION."""
    from app.core.migrate import upgrade

    upgrade(revision=revision)
    typer.echo(json.dumps({"revision": revision}) if as_json else f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="target revision, e.g. base"), as_json: bool = JSON) -> None:
    """Migrate the configured database down to REVISION."""
    from app.core.migrate import downgrade

    downgrade(revision=revision)
    typer.echo(json.dumps({"revision": revision}) if as_json else f"database at {revision}")


@events_app.command("schema")
def events_schema(
    out: Path | None = typer.Option(None, "--out", "-o", help="file to write; stdout if omitted"),
) -> None:
    """Write the JSON Schema of the event envelope and every event type."""
    from producers.events import event_json_schema

    text = json.dumps(event_json_schema(), indent=2, sort_keys=True)
    if out is None:
        sys.stdout.write(text + "\n")
    else:
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}")


def register(app: typer.Typer) -> None:
    """Add ``db`` and ``events`` to the main app."""
    app.add_typer(db_app, name="db")
    app.add_typer(events_app, name="events")

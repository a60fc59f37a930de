"""The ``flywheel`` CLI: a thin entry point that imports heavy modules (torch, FastAPI, Celery)
only inside the command that needs them, so ``flywheel --help`` stays fast.

Each package contributes its commands through ``register(app)`` in its own ``cli`` module.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="flywheel: event-sourced online RL for a coding-agent model.")
db_app = typer.Typer(no_args_is_help=True, help="Database migrations.")
events_app = typer.Typer(no_args_is_help=True, help="The event contract.")
app.add_typer(db_app, name="db")
app.add_typer(events_app, name="events")


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="target revision")) -> None:
    """Migrate the configured database (FLYWHEEL_DATABASE_URL or the local stack) to REVISION."""
    from app.core.migrate import upgrade

    upgrade(revision=revision)
    typer.echo(f"database at {revision}")


@db_app.command("downgrade")
def db_downgrade(revision: str = typer.Argument(..., help="target revision, e.g. base")) -> None:
    """Migrate the configured database down to REVISION."""
    from app.core.migrate import downgrade

    downgrade(revision=revision)
    typer.echo(f"database at {revision}")


@events_app.command("schema")
def events_schema(out: Path | None = typer.Option(None, "--out", "-o", help="file to write; stdout if omitted")) -> None:
    """Write the JSON Schema of the event envelope and every event type."""
    from app.events import event_json_schema

    text = json.dumps(event_json_schema(), indent=2, sort_keys=True)
    if out is None:
        sys.stdout.write(text + "\n")
    else:
        out.write_text(text + "\n")
        typer.echo(f"wrote {out}")


def _register_all() -> None:
    # Each module imports only typer and the light core at import time.
    from app.api import cli as api_cli
    from consumers import cli as consumers_cli
    from evals import cli as evals_cli
    from ops import cli as ops_cli
    from ops.serving import cli as serving_cli
    from producers import cli as producers_cli
    from trainer import cli as trainer_cli

    for module in (ops_cli, consumers_cli, serving_cli, producers_cli, trainer_cli, evals_cli, api_cli):
        module.register(app)


_register_all()


def main() -> None:
    """Console-script entry point: a :class:`FlywheelError`, a database that cannot be reached, or one
    not migrated to this release, ends with its message on stderr and exit code 2 instead of a traceback."""
    from app.core.errors import FlywheelError

    try:
        app()
    except FlywheelError as exc:
        typer.secho(f"error: {exc.message}", fg="red", err=True)
        for reason in exc.reasons:
            typer.secho(f"  - {reason}", fg="red", err=True)
        raise SystemExit(2) from None
    except Exception as exc:
        from app.core.db import schema_missing_reason, unreachable_reason

        reason = unreachable_reason(exc)
        if reason is not None:
            typer.secho(f"error: the database does not answer: {reason}", fg="red", err=True)
            typer.secho("  - check FLYWHEEL_DATABASE_URL, or start the local stack: flywheel stack up", fg="red",
                        err=True)
            raise SystemExit(2) from None
        reason = schema_missing_reason(exc)
        if reason is not None:
            typer.secho(f"error: the database lacks this release's schema: {reason}", fg="red", err=True)
            typer.secho("  - migrate it: flywheel db upgrade", fg="red", err=True)
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    main()

"""The root of the ``flywheel`` command. Each package contributes its commands through
``register(app)`` in its own ``cli`` (or ``commands``) module, which imports heavy modules (torch,
FastAPI, Celery) only inside the command that needs them, so ``flywheel --help`` stays fast.
"""

from __future__ import annotations

import typer

from app import commands as app_commands
from app.api import cli as api_cli
from app.core.errors import FlywheelError
from consumers import cli as consumers_cli
from evals import cli as evals_cli
from ops import ab_cli, simulator_cli
from ops import commands as ops_commands
from serving import cli as serving_cli
from trainer import cli as trainer_cli

app = typer.Typer(
    no_args_is_help=True, add_completion=False, help="flywheel: event-sourced online RL for a coding-agent model."
)


def _register_all() -> None:
    # Each package registers its own commands; each module imports only typer and the light core at
    # import time, so ``flywheel --help`` stays fast.
    for module in (
        app_commands,
        ops_commands,
        consumers_cli,
        serving_cli,
        simulator_cli,
        trainer_cli,
        evals_cli,
        ab_cli,
        api_cli,
    ):
        module.register(app)


_register_all()


def main() -> None:
    """Console-script entry point: a :class:`FlywheelError`, a database that cannot be reached, or one
    not migrated to this release, ends with its message on stderr and exit code 2 instead of a traceback."""
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
            typer.secho(
                "  - check FLYWHEEL_DATABASE_URL, or start the local stack: flywheel stack up", fg="red", err=True
            )
            raise SystemExit(2) from None
        reason = schema_missing_reason(exc)
        if reason is not None:
            typer.secho(f"error: the database lacks this release's schema: {reason}", fg="red", err=True)
            typer.secho("  - migrate it: flywheel db upgrade", fg="red", err=True)
            raise SystemExit(2) from None
        raise


if __name__ == "__main__":
    main()

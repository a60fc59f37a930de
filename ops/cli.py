"""The root of the ``flywheel`` command. Each package contributes its commands through
``register(app)`` in its own ``cli`` (or ``commands``) module, which imports heavy modules (torch,
FastAPI, Celery) only inside the command that needs them, so ``flywheel --help`` stays fast.
"""

from __future__ import annotations

import traceback

import typer

from app import commands as app_commands
from app.api import cli as api_cli
from consumers import cli as consumers_cli
from evals import cli as evals_cli
from ops import ab_cli, capacity_cli, settings_cli, simulator_cli
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
        settings_cli,
        capacity_cli,
    ):
        module.register(app)


_register_all()


def run(argv: list[str] | None = None) -> int:
    """Run the ``flywheel`` command line on ``argv`` (default: ``sys.argv[1:]``) and return its exit
    code, by the convention of :class:`app.core.failures.ExitCode`: 0 done, 1 a negative answer, 2 a
    usage error, 3 a service unreachable, 4 a bug. A failure prints its message (and hints) on
    stderr instead of a traceback; a bug prints its traceback."""
    try:
        app(args=argv, prog_name="flywheel")
    except SystemExit as exc:  # click ends every command this way, usage errors (2) included
        if isinstance(exc.code, str):  # sys.exit("message"): Python would print it
            typer.echo(exc.code, err=True)
        return exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    except Exception as exc:
        from app.core.failures import ExitCode, classify

        failure = classify(exc)
        if failure.code is ExitCode.INTERNAL:
            traceback.print_exception(exc)
        typer.secho(f"error: {failure.message}", fg="red", err=True)
        for hint in failure.hints:
            typer.secho(f"  - {hint}", fg="red", err=True)
        return int(failure.code)
    return 0


def main() -> None:
    """Console-script entry point: exits with :func:`run`'s code."""
    raise SystemExit(run())


if __name__ == "__main__":
    main()

"""``flywheel stack``, ``worker``, ``beat``, ``up`` and ``demo``. Heavy imports stay inside commands."""

from __future__ import annotations

import typer

stack_app = typer.Typer(no_args_is_help=True, help="The local embedded stack (Postgres + Kafka-compatible broker).")


@stack_app.command("up")
def stack_up_cmd(partitions: int = typer.Option(None, help="partitions of the interactions topic")) -> None:
    """Start embedded Postgres and the broker (unless configured), create topics, migrate."""
    from app.core.migrate import upgrade
    from app.core.settings import get_settings
    from ops.stack import stack_up

    state = stack_up(partitions=partitions)
    get_settings.cache_clear()
    upgrade(url=state.database_url)
    typer.echo(f"postgres {state.database_url}\nkafka    {state.kafka_bootstrap}")


@stack_app.command("down")
def stack_down_cmd() -> None:
    """Stop only the processes the stack started."""
    from ops.stack import stack_down

    stopped = stack_down()
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing"))


@stack_app.command("status")
def stack_status_cmd() -> None:
    """Health of Postgres and the broker; exit 1 if either is down."""
    from rich.console import Console
    from rich.table import Table

    from ops.stack import stack_status

    status = stack_status()
    table = Table("service", "address", "pid", "healthy")
    for name, s in status.items():
        table.add_row(name, str(s.get("url") or s.get("bootstrap") or "-"), str(s.get("pid") or "external"),
                      "[green]yes[/]" if s["healthy"] else "[red]no[/]")
    Console().print(table)
    if not all(s["healthy"] for s in status.values()):
        raise typer.Exit(1)


# ---- Celery ---------------------------------------------------------------------------------

def worker_cmd(
    concurrency: int = typer.Option(1, "--concurrency", "-c", min=1, help="tasks run at once"),
    pool: str | None = typer.Option(None, help="solo | prefork | threads (default: solo for 1, else prefork)"),
    queues: str | None = typer.Option(None, "--queues", "-Q", help="comma-separated queues to consume"),
    beat: bool = typer.Option(False, "--beat", "-B", help="also run the beat scheduler in this process"),
    loglevel: str = typer.Option("INFO", "--loglevel", "-l"),
) -> None:
    """Run a Celery worker for flywheel's tasks (training cycles, eval gating, outbox relay)."""
    from ops.celery_app import celery_app

    argv = ["worker", f"--pool={pool or ('solo' if concurrency == 1 else 'prefork')}",
            f"--concurrency={concurrency}", f"--loglevel={loglevel}"]
    if queues:
        argv.append(f"--queues={queues}")
    if beat:
        argv.append("--beat")
    celery_app.worker_main(argv)


def beat_cmd(loglevel: str = typer.Option("INFO", "--loglevel", "-l")) -> None:
    """Run the Celery beat scheduler (one per deployment; schedule in ops/schedule.py)."""
    from ops.celery_app import celery_app

    celery_app.start(["beat", f"--loglevel={loglevel}"])


def register(app: typer.Typer) -> None:
    """Add ``stack``, ``worker`` and ``beat`` (and, as they land, up/demo) to the main app."""
    app.add_typer(stack_app, name="stack")
    app.command("worker")(worker_cmd)
    app.command("beat")(beat_cmd)

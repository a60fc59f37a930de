"""CLI commands of the promotion API: ``flywheel api``, ``tokens``, ``relay``, ``watch``.

Heavy modules (FastAPI, uvicorn, SQLAlchemy models, kafka) are imported inside the commands, so
``flywheel --help`` stays fast.
"""

from __future__ import annotations

import typer

tokens_app = typer.Typer(no_args_is_help=True, help="API bearer tokens (stored as sha256 hashes).")


def _cli_actor() -> str:
    import getpass

    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (containers): still record that the CLI did it
        return "cli:unknown"


@tokens_app.command("create")
def tokens_create(role: str = typer.Option(..., help="viewer | release_manager | service"),
                  name: str = typer.Option(..., help="unique name; recorded as the actor of its writes")) -> None:
    """Create a token and print it ONCE (only its sha256 is stored)."""
    from app.core.db import session_scope
    from app.promotion.tokens import create_token

    with session_scope() as session:
        row, raw = create_token(session, name=name, role=role, actor=_cli_actor())
        token_id = row.id
    typer.echo(raw)
    typer.secho(f"token {name!r} ({role}, id {token_id}) created; it is shown only once", err=True, fg="green")


@tokens_app.command("revoke")
def tokens_revoke(name_or_id: str = typer.Argument(..., help="token name or id")) -> None:
    """Revoke a live token (it stops authenticating immediately)."""
    from app.core.db import session_scope
    from app.promotion.tokens import revoke_token

    with session_scope() as session:
        row = revoke_token(session, name_or_id, actor=_cli_actor())
        typer.echo(f"revoked {row.name} ({row.role}, id {row.id})")


@tokens_app.command("list")
def tokens_list(all_: bool = typer.Option(False, "--all", help="include revoked tokens")) -> None:
    """List tokens (name, role, id, created, revoked)."""
    from rich.console import Console
    from rich.table import Table

    from app.core.db import session_scope
    from app.promotion.tokens import list_tokens

    table = Table("name", "role", "id", "created", "revoked")
    with session_scope() as session:
        for t in list_tokens(session, include_revoked=all_):
            table.add_row(t.name, t.role, str(t.id), f"{t.created_at:%Y-%m-%d %H:%M}",
                          f"{t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "-")
    Console().print(table)


def api(host: str = typer.Option(None, help="default FLYWHEEL_API_HOST (127.0.0.1)"),
        port: int = typer.Option(None, help="default FLYWHEEL_API_PORT (8000)"),
        workers: int = typer.Option(1, min=1, help="uvicorn worker processes")) -> None:
    """Serve the promotion API and the dashboard (uvicorn)."""
    import uvicorn

    from app.core.settings import get_settings

    s = get_settings().api
    uvicorn.run("app.api.main:create_app", factory=True, host=host or s.host, port=port or s.port,
                workers=workers, proxy_headers=True, log_level="info")


def relay(once: bool = typer.Option(False, "--once", help="publish what is pending, then exit"),
          interval: float = typer.Option(None, help="seconds between polls (default FLYWHEEL_OUTBOX_INTERVAL)"),
          batch: int = typer.Option(100, min=1, help="rows per transaction")) -> None:
    """Publish outbox rows to their topics, in order, marking each sent after the broker acks."""
    from app.core.settings import get_settings
    from app.core.telemetry import configure_service_logging, configure_telemetry
    from producers.relay import OutboxRelay

    configure_service_logging()
    configure_telemetry("flywheel-relay")
    with OutboxRelay(batch_size=batch) as r:
        if once:
            typer.echo(f"published {r.relay_pending()} message(s)")
            return
        r.run_forever(interval_s=interval or get_settings().celery.outbox_interval)


def watch(once: bool = typer.Option(False, "--once", help="handle what is on the topic now, then exit")) -> None:
    """Follow production: move the inference engine on checkpoint.promoted / rolled_back and report
    the serving checkpoint in $FLYWHEEL_HOME/serving.json."""
    from app.core.telemetry import configure_service_logging, configure_telemetry
    from ops.serving.watcher import run_watch

    configure_service_logging()
    configure_telemetry("flywheel-watcher")
    run_watch(once=once)


def register(app: typer.Typer) -> None:
    """Add ``api``, ``tokens``, ``relay`` and ``watch`` to the main app."""
    app.add_typer(tokens_app, name="tokens")
    app.command("api")(api)
    app.command("relay")(relay)
    app.command("watch")(watch)

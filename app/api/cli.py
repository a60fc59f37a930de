"""CLI commands of the promotion API: ``flywheel api``, ``tokens``, ``canary``, ``relay``, ``watch``.

Heavy modules (FastAPI, uvicorn, SQLAlchemy models, kafka) are imported inside the commands, so
``flywheel --help`` stays fast.
"""

from __future__ import annotations

import getpass
import json
import uuid
from typing import TYPE_CHECKING

import typer

if TYPE_CHECKING:  # the commands import the models when they run, so `flywheel --help` stays light
    from app.models import Canary

tokens_app = typer.Typer(no_args_is_help=True, help="API bearer tokens (stored as sha256 hashes).")
JSON = typer.Option(False, "--json", help="print the result as JSON")
canary_app = typer.Typer(
    no_args_is_help=True, help="Canary: serve a gate-passed candidate to a sticky fraction of users beside production."
)


def _cli_actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no passwd entry (containers): still record that the CLI did it
        return "cli:unknown"


@tokens_app.command("create")
def tokens_create(
    role: str = typer.Option(..., help="viewer | release_manager | service | inference (the serving front's callers)"),
    name: str = typer.Option(..., help="unique name; recorded as the actor of its writes"),
    as_json: bool = JSON,
) -> None:
    """Create a token and print it ONCE (only its sha256 is stored)."""
    from app.core.db import session_scope
    from app.repositories.tokens import create_token

    with session_scope() as session:
        row, raw = create_token(session, name=name, role=role, actor=_cli_actor())
        token_id = row.id
    if as_json:
        typer.echo(json.dumps({"token": raw, "name": name, "role": role, "id": str(token_id)}))
        return
    typer.echo(raw)
    typer.secho(f"token {name!r} ({role}, id {token_id}) created; it is shown only once", err=True, fg="green")


@tokens_app.command("revoke")
def tokens_revoke(name_or_id: str = typer.Argument(..., help="token name or id"), as_json: bool = JSON) -> None:
    """Revoke a live token (it stops authenticating immediately)."""
    from app.core.db import session_scope
    from app.repositories.tokens import revoke_token

    with session_scope() as session:
        row = revoke_token(session, name_or_id, actor=_cli_actor())
        if as_json:
            typer.echo(json.dumps({"revoked": {"name": row.name, "role": row.role, "id": str(row.id)}}))
        else:
            typer.echo(f"revoked {row.name} ({row.role}, id {row.id})")


@tokens_app.command("list")
def tokens_list(all_: bool = typer.Option(False, "--all", help="include revoked tokens"), as_json: bool = JSON) -> None:
    """List tokens (name, role, id, created, revoked); with --json, one JSON object per line."""
    from rich.console import Console
    from rich.table import Table

    from app.core.db import session_scope
    from app.repositories.tokens import list_tokens

    table = Table("name", "role", "id", "created", "revoked")
    with session_scope() as session:
        for t in list_tokens(session, include_revoked=all_):
            if as_json:
                typer.echo(
                    json.dumps(
                        {
                            "name": t.name,
                            "role": t.role,
                            "id": str(t.id),
                            "created_at": t.created_at.isoformat(),
                            "revoked_at": t.revoked_at.isoformat() if t.revoked_at else None,
                        }
                    )
                )
                continue
            table.add_row(
                t.name,
                t.role,
                str(t.id),
                f"{t.created_at:%Y-%m-%d %H:%M}",
                f"{t.revoked_at:%Y-%m-%d %H:%M}" if t.revoked_at else "-",
            )
    if not as_json:
        Console().print(table)


@canary_app.command("start")
def canary_start(
    checkpoint_id: str = typer.Argument(..., help="a gate-passed candidate"),
    fraction: float = typer.Option(..., min=0.0, max=1.0, help="share of users, strictly between 0 and 1"),
    reason: str = typer.Option(..., help="why (recorded in the audit log)"),
    as_json: bool = JSON,
) -> None:
    """Start a canary (audited, announced on the lifecycle topic through the outbox)."""
    if not 0.0 < fraction < 1.0:
        raise typer.BadParameter("must be strictly between 0 and 1 (1 is a promotion)", param_hint="--fraction")
    from app.core.db import session_scope
    from app.lifecycle.canary import start_canary

    with session_scope() as session:
        row = start_canary(session, checkpoint_id=checkpoint_id, fraction=fraction, actor=_cli_actor(), reason=reason)
        if as_json:
            typer.echo(json.dumps(_canary_dict(row)))
            return
        typer.echo(
            f"canary {row.id}: {row.checkpoint_id} serves {row.fraction:.1%} of users beside {row.production_id}"
        )


@canary_app.command("stop")
def canary_stop(
    reason: str = typer.Option(..., help="why (recorded in the audit log)"),
    canary_id: str = typer.Option(None, "--id", help="canary id (default: the active one)"),
    as_json: bool = JSON,
) -> None:
    """Stop a canary: every user is served by production again."""
    from app.core.db import session_scope
    from app.lifecycle.canary import stop_canary

    with session_scope() as session:
        row = stop_canary(
            session, actor=_cli_actor(), reason=reason, canary_id=uuid.UUID(canary_id) if canary_id else None
        )
        if as_json:
            typer.echo(json.dumps(_canary_dict(row)))
            return
        typer.echo(f"canary {row.id} of {row.checkpoint_id} stopped")


@canary_app.command("evaluate")
def canary_evaluate() -> None:
    """Apply the canary policy now (what the beat task does every FLYWHEEL_CANARY_EVAL_INTERVAL s): end
    the active canary if a signal regressed significantly, mark it ready if it ran its planned size
    without one. Prints the evaluation as JSON."""
    from app.core.db import session_scope
    from app.promotion.canary_policy import evaluate_canary

    with session_scope() as session:
        result = evaluate_canary(session, actor=_cli_actor())
    typer.echo(json.dumps(result.as_dict()))


@canary_app.command("status")
def canary_status(as_json: bool = JSON) -> None:
    """The active canary and its online signals versus production (95 % intervals clustered by user).
    With --json: the canary's row, ``ready_since`` and the online view (signals, policy verdict);
    ``{"canary": null}`` when none has run."""
    from rich.console import Console
    from rich.table import Table

    from app.core.db import session_scope
    from app.lifecycle.canary import get_active_canary, list_canaries
    from app.lifecycle.online import online_view
    from app.promotion.canary_policy import ready_times
    from app.repositories.checkpoints import get_checkpoint

    with session_scope() as session:
        canary = get_active_canary(session) or next(iter(list_canaries(session, limit=1)), None)
        if canary is None:
            typer.echo(json.dumps({"canary": None}) if as_json else "no canary has run")
            return
        view = online_view(session, get_checkpoint(session, canary.checkpoint_id))["canary"]
        ready = ready_times(session, [canary.id]).get(str(canary.id))
        if as_json:
            row = _canary_dict(canary)
            ready_since = ready.isoformat() if ready is not None else None
            typer.echo(json.dumps({"canary": row, "ready_since": ready_since, "online": view}, default=str))
            return
        typer.echo(
            f"canary {canary.id} ({canary.status}): {canary.checkpoint_id} on {canary.fraction:.1%} of users "
            f"vs {canary.production_id}; sessions {view['canary_sessions']} vs {view['production_sessions']}"
        )
        if ready is not None:
            typer.echo(f"ready for promotion since {ready:%Y-%m-%d %H:%M} (the canary policy)")
        if canary.stop_reason:
            typer.echo(f"stopped by {canary.stopped_by}: {canary.stop_reason}")
    table = Table("signal", "canary", "production", "diff", "95% CI", "regressed")

    def fmt(v: float | None) -> str:
        return "-" if v is None else f"{v:.4g}"

    for name, d in view["signals"].items():
        ci = "-" if d["low"] is None else f"{d['low']:+.4g}..{d['high']:+.4g}"
        table.add_row(name, fmt(d["canary"]), fmt(d["production"]), fmt(d["diff"]), ci, "YES" if d["regressed"] else "")
    Console().print(table)
    verdict = "allows promotion" if view["policy_passed"] else "refuses promotion"
    typer.echo(f"online policy {verdict}" + "".join(f"\n  - {r}" for r in view["policy_reasons"]))


def _canary_dict(row: Canary) -> dict[str, object]:
    """A canary row as JSON-ready values."""
    return {
        "id": str(row.id),
        "checkpoint_id": row.checkpoint_id,
        "production_id": row.production_id,
        "fraction": row.fraction,
        "status": row.status,
        "actor": row.actor,
        "reason": row.reason,
        "started_at": row.started_at.isoformat() if row.started_at else None,
        "stopped_at": row.stopped_at.isoformat() if row.stopped_at else None,
        "stop_reason": row.stop_reason,
        "stopped_by": row.stopped_by,
    }


def api(
    host: str = typer.Option(None, help="default FLYWHEEL_API_HOST (127.0.0.1)"),
    port: int = typer.Option(None, help="default FLYWHEEL_API_PORT (8000)"),
    workers: int = typer.Option(1, min=1, help="uvicorn worker processes"),
) -> None:
    """Serve the promotion API and the dashboard (uvicorn); its log lines (uvicorn's included) are
    text on a terminal, JSON lines otherwise (FLYWHEEL_LOG_FORMAT)."""
    import uvicorn

    from app.core.settings import get_settings
    from app.core.telemetry import configure_service_logging

    configure_service_logging(service="flywheel-api")

    s = get_settings().api
    uvicorn.run(
        "app.api.main:create_app",
        factory=True,
        host=host or s.host,
        port=port or s.port,
        workers=workers,
        proxy_headers=True,
        log_level="info",
        log_config=None,  # uvicorn's loggers propagate to the root handler configured above
    )


def relay(
    once: bool = typer.Option(False, "--once", help="publish what is pending, then exit"),
    interval: float = typer.Option(None, help="seconds between polls (default FLYWHEEL_OUTBOX_INTERVAL)"),
    batch: int = typer.Option(100, min=1, help="rows per transaction"),
    as_json: bool = typer.Option(False, "--json", help="with --once, print the count as JSON"),
) -> None:
    """Publish outbox rows to their topics, in order, marking each sent after the broker acks."""
    from app.core.settings import get_settings
    from app.core.telemetry import configure_service_logging, configure_telemetry
    from app.outbox.relay import OutboxRelay

    configure_service_logging(service="flywheel-relay")
    configure_telemetry("flywheel-relay", metrics_port=not once)
    with OutboxRelay(batch_size=batch) as r:
        if once:
            published = r.relay_pending()
            typer.echo(json.dumps({"published": published}) if as_json else f"published {published} message(s)")
            return
        r.run_forever(interval_s=interval or get_settings().celery.outbox_interval)


def register(app: typer.Typer) -> None:
    """Add ``api``, ``tokens``, ``canary`` and ``relay`` to the main app."""
    app.add_typer(tokens_app, name="tokens")
    app.add_typer(canary_app, name="canary")
    app.command("api")(api)
    app.command("relay")(relay)

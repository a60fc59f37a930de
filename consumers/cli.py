"""CLI commands of this package (registered on the main ``flywheel`` app): ``consume``, ``finalize``,
``relabel``, ``replay``, ``erase``, ``erasures``, ``rewards``, ``deadletters``. Heavy modules are imported inside
the commands."""

from __future__ import annotations

import dataclasses
import json
import logging
import signal
import uuid
from typing import TYPE_CHECKING, Any

import typer

if TYPE_CHECKING:  # commands import what they run, so `flywheel --help` stays light
    from sqlalchemy.orm import Session

rewards_app = typer.Typer(no_args_is_help=True, help="Reward specs (TOML, name@version).")
deadletters_app = typer.Typer(
    no_args_is_help=True, help="Dead letters: counts by reason, listing, redrive to the source topic."
)
erasures_app = typer.Typer(no_args_is_help=True, help="Right-to-erasure requests and what each one erased.")


def _setup(service: str, metrics_port: bool = False) -> None:
    from app.core.telemetry import configure_service_logging, configure_telemetry

    configure_service_logging(service=service)
    configure_telemetry(service, metrics_port=metrics_port)


def _warn_if_schema_behind() -> None:
    """Say once, at start, that the database lacks this release's migrations: the consumer then
    retries its batches until they run (``app.core.retry.is_transient``) and logs each retry."""
    from app.core.db import get_engine
    from app.core.migrate import schema_behind

    try:
        with get_engine().connect() as conn:
            behind = schema_behind(conn)
    except Exception:  # noqa: BLE001 -- unreachable now: the consumer's own retries report it
        return
    if behind:
        logging.getLogger("consumers").warning(
            "%s: batches wait and are retried until `flywheel db upgrade` has run; nothing is dead-lettered or lost",
            behind,
        )


def consume(
    group: str = typer.Option(None, help="consumer group (default FLYWHEEL_KAFKA_CONSUMER_GROUP)"),
    topic: str = typer.Option(None, help="topic (default FLYWHEEL_KAFKA_INTERACTIONS_TOPIC)"),
    idle_exit: float = typer.Option(None, help="exit after this many seconds without records"),
    stop_after: int = typer.Option(None, help="exit after this many records"),
) -> None:
    """Run one ingest consumer: Kafka -> event_log + trajectories + offsets, one transaction per batch.
    Start several to split the partitions. SIGTERM/SIGINT finish the current batch and leave the group."""
    from consumers.ingest import IngestConsumer

    _setup("flywheel-consumer", metrics_port=True)
    _warn_if_schema_behind()
    consumer = IngestConsumer(topic=topic, group_id=group)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: consumer.stop())
    stats = consumer.run(idle_exit_s=idle_exit, stop_after=stop_after)
    typer.echo(
        json.dumps(
            {
                **{k: v for k, v in dataclasses.asdict(stats).items() if isinstance(v, int)},
                "dead_letters": dict(stats.dead_letters),
                "finalized": dict(stats.finalized),
            }
        )
    )


def finalize() -> None:
    """Finalize provisional trajectories whose late-signal window has closed, and label them."""
    from consumers.finalize import finalize_due
    from consumers.ingest import projector_from_settings
    from consumers.settings import get_consumer_settings

    _setup("flywheel-finalize")
    done = finalize_due(projector_from_settings(), get_consumer_settings().finalize_grace_s)
    typer.echo(json.dumps({"finalized": dict(done)}))


def relabel(
    spec: str = typer.Option(..., "--spec", help="reward spec name@version, e.g. implicit@2"),
    baseline: str = typer.Option(
        None, help="spec whose labels are 'before' (default: the same spec, or the first active one)"
    ),
    as_json: bool = typer.Option(False, "--json", help="print the report as JSON"),
) -> None:
    """Recompute labels of finalized trajectories from event_log (late signals included) and show how
    the reward distribution moved."""
    from rich.console import Console
    from rich.table import Table

    from consumers.relabel import relabel as run_relabel

    report = run_relabel(spec, baseline=baseline)
    if as_json:
        typer.echo(json.dumps(report.to_dict()))
        return
    table = Table(
        "",
        f"before ({report.baseline})",
        f"after ({report.spec})",
        "delta",
        title=f"relabeled {report.relabeled} trajectories, {report.changed} changed, "
        f"{report.late_signals_used} late signals now counted",
    )

    def cell(v: float | None, fmt: str) -> str:
        return "-" if v is None else format(v, fmt)

    for k in ("n", "mean", "std", "min", "p10", "p25", "p50", "p75", "p90", "max"):
        b, a = report.before.get(k), report.after.get(k)
        fmt = "d" if k == "n" else ".4f"
        table.add_row(k, cell(b, fmt), cell(a, fmt), cell(None if a is None or b is None else a - b, "+" + fmt))
    Console().print(table)
    if not report.relabeled:
        typer.echo("no finalized trajectories to relabel yet", err=True)


def _shadow_schema_name(name: str | None) -> str | None:
    from consumers.replay import is_schema_name

    if name is not None and not is_schema_name(name):
        raise typer.BadParameter(
            f"{name!r} is not a schema name replay creates: lower-case letters, digits and _, "
            "not starting with a digit, at most 63 characters"
        )
    return name


def replay(
    schema: str = typer.Option(
        None,
        callback=_shadow_schema_name,
        help="rebuild into this new schema (live tables untouched) instead of in place",
    ),
    verify: bool = typer.Option(
        False,
        help="rebuild into a scratch schema and diff it with the live tables, both as "
        "of one snapshot (safe beside running consumers); exit 1 if they differ",
    ),
    drop_schema: str = typer.Option(
        None,
        "--drop-schema",
        callback=_shadow_schema_name,
        help="drop a schema an earlier `replay --schema` made, and nothing else",
    ),
) -> None:
    """Rebuild trajectories, segments and labels from event_log into empty tables."""
    import psycopg

    from app.core.db import session_scope
    from consumers.ingest import projector_from_settings
    from consumers.replay import drop_shadow_schema
    from consumers.replay import replay as run_replay
    from consumers.replay import verify as run_verify
    from consumers.settings import get_consumer_settings

    if sum(map(bool, (verify, schema, drop_schema))) > 1:
        raise typer.BadParameter(
            "--schema, --verify and --drop-schema are separate uses; give one", param_hint="--schema"
        )
    if drop_schema:
        with session_scope() as session:
            drop_shadow_schema(session, drop_schema)
        typer.echo(json.dumps({"dropped": drop_schema}))
        return
    grace = get_consumer_settings().finalize_grace_s
    if verify:
        checked = run_verify(projector_from_settings(), grace_s=grace)
        report, diffs = checked.replay, checked.differences
    else:
        try:
            report = run_replay(projector_from_settings(), grace_s=grace, schema=schema)
        except psycopg.errors.DuplicateSchema:
            raise typer.BadParameter(
                f"schema {schema!r} already exists: pick another name, or drop it first with "
                f"`flywheel replay --drop-schema {schema}` if an earlier replay made it",
                param_hint="--schema",
            ) from None
    result: dict[str, Any] = {
        "events": report.events,
        "trajectories": report.trajectories,
        "finalized_by_window": report.finalized_by_window,
        "schema": report.schema,
        "skipped_invalid": len(report.skipped_invalid),
    }
    if verify:
        result.update(identical=not diffs, differences=diffs, due_unswept=checked.due_unswept)
    elif schema is None:
        result["labels_not_rebuilt"] = report.labels_not_rebuilt
        for spec, n in report.labels_not_rebuilt.items():
            typer.echo(
                f"{n} labels under {spec} (not an active spec: a relabel wrote them) were dropped with the old "
                f"rows; run `flywheel relabel --spec {spec}` again to restore them",
                err=True,
            )
    typer.echo(json.dumps(result))
    if verify and diffs:
        raise typer.Exit(1)


def erase(
    user: str = typer.Argument(..., help="pseudonymous user id"),
    request_id: str = typer.Option(None, help="idempotency key (default: a new uuid)"),
) -> None:
    """Erase a user now (same path as a user.erasure_requested event): events, trajectories, dead
    letters, eval tasks mined from their sessions; flag checkpoints trained on them and their
    descendants, and roll a flagged production back to its newest clean ancestor."""
    from app.core.db import session_scope
    from consumers.erasure import erase_now

    with session_scope() as s:
        out = erase_now(s, user, request_id or str(uuid.uuid4()))
    typer.echo(
        json.dumps(
            {
                "request_id": out.request_id,
                "events_deleted": out.events_deleted,
                "trajectories_deleted": out.trajectories_deleted,
                "dead_letters_deleted": out.dead_letters_deleted,
                "eval_tasks_deleted": out.eval_tasks_deleted,
                "checkpoints_flagged": out.checkpoints_flagged,
                "production_rolled_back_to": out.rolled_back_to,
                "production_unresolved": out.production_unresolved,
                "repeated": out.repeated,
                "request_id_reused_from": out.reused_by,
            }
        )
    )


@erasures_app.command("list")
def erasures_list(
    user: str = typer.Option(None, help="only this (pseudonymous) user's requests"),
    limit: int = typer.Option(50, min=1, max=10_000, help="at most this many requests"),
) -> None:
    """Applied erasure requests, newest first (JSON lines): (user, request id), when requested and
    applied, outcome, what was deleted and which checkpoints were flagged."""
    from app.core.db import session_scope
    from consumers.erasure import list_erasures

    with session_scope() as s:
        for row in list_erasures(s, user_id=user, limit=limit):
            typer.echo(json.dumps(row))


@rewards_app.command("list")
def rewards_list(as_json: bool = typer.Option(False, "--json", help="one JSON object per spec and line")) -> None:
    """Available reward specs (shipped and FLYWHEEL_CONSUMER_REWARD_SPEC_DIR), active ones marked."""
    from consumers.rewards.spec import available_specs
    from consumers.settings import get_consumer_settings

    active = set(get_consumer_settings().reward_specs)
    for spec_id, spec in sorted(available_specs().items()):
        if as_json:
            row = {"spec": spec_id, "active": spec_id in active, "digest": spec.digest()}
            typer.echo(json.dumps({**row, "description": spec.description}))
            continue
        typer.echo(f"{'*' if spec_id in active else ' '} {spec_id:20s} {spec.digest()}  {spec.description}")


@rewards_app.command("show")
def rewards_show(spec: str = typer.Argument(..., help="name@version")) -> None:
    """The resolved spec as JSON."""
    from consumers.rewards.spec import load_spec

    typer.echo(json.dumps(load_spec(spec).model_dump(mode="json"), indent=2))


@deadletters_app.command("stats")
def deadletters_stats() -> None:
    """Dead letters by reason: how many, how many never redriven, first and last stored (JSON lines)."""
    from app.core.db import session_scope
    from consumers.redrive import dead_letter_stats

    with session_scope() as s:
        for row in dead_letter_stats(s):
            typer.echo(json.dumps(row))


@deadletters_app.command("list")
def deadletters_list(
    reason: str = typer.Option(None, help="only this reason (bad_json, validation, processing_error, ...)"),
    pending: bool = typer.Option(False, help="only dead letters never redriven"),
    limit: int = typer.Option(50, min=1, max=10_000, help="at most this many rows"),
    after: int = typer.Option(0, min=0, help="rows with a larger id (page on from the last id shown)"),
) -> None:
    """Dead letters oldest first (JSON lines): position, reason, detail, claimed user, size."""
    from app.core.db import session_scope
    from consumers.redrive import list_dead_letters

    with session_scope() as s:
        rows = list_dead_letters(s, reason=reason, pending_only=pending, limit=limit, after_id=after)
        for row in rows:
            typer.echo(json.dumps(row))
        if not rows and reason is not None:
            _hint_reasons(s, [reason])


def _hint_reasons(session: Session, asked: list[str]) -> None:
    """On stderr, which of ``asked`` no dead letter has, next to the reasons there are (a typo shows)."""
    from sqlalchemy import text

    seen = sorted(session.execute(text("SELECT DISTINCT reason FROM dead_letter")).scalars())
    unknown = [r for r in asked if r not in seen]
    if unknown:
        typer.echo(
            f"no dead letter has reason {', '.join(unknown)}; reasons stored: {', '.join(seen) or 'none'}", err=True
        )


@deadletters_app.command("redrive")
def deadletters_redrive(
    reason: list[str] = typer.Option(None, "--reason", help="redrive dead letters with this reason (repeatable)"),
    ids: list[int] = typer.Option(None, "--id", help="redrive this dead letter (repeatable)"),
    select_all: bool = typer.Option(False, "--all", help="redrive every dead letter"),
    again: bool = typer.Option(False, help="include dead letters already redriven"),
    dry_run: bool = typer.Option(False, help="report what would be published; publish nothing"),
    topic: str = typer.Option(None, help="publish here instead of each dead letter's source topic"),
) -> None:
    """Publish dead letters' raw bytes back to their source topic for the consumers to decide again
    (e.g. after a fix). At least once; stored events deduplicate on event_id."""
    from consumers.redrive import redrive

    if not (reason or ids or select_all):
        raise typer.BadParameter("choose what to redrive: --reason REASON, --id ID or --all")
    report = redrive(
        reasons=reason or (), ids=ids or (), select_all=select_all, again=again, dry_run=dry_run, topic=topic
    )
    typer.echo(json.dumps(report.to_dict()))
    if reason:
        from app.core.db import session_scope

        with session_scope() as s:
            _hint_reasons(s, reason)


def register(app: typer.Typer) -> None:
    """Add this package's commands to the main app."""
    app.command("consume")(consume)
    app.command("finalize")(finalize)
    app.command("relabel")(relabel)
    app.command("replay")(replay)
    app.command("erase")(erase)
    app.add_typer(rewards_app, name="rewards")
    app.add_typer(deadletters_app, name="deadletters")
    app.add_typer(erasures_app, name="erasures")

"""``flywheel stack``, ``worker``, ``beat``, ``up`` and ``demo``. Heavy imports stay inside commands."""

from __future__ import annotations

import json
import time

import typer
from rich.console import Console
from rich.table import Table

from app.core.errors import ConfigurationError

JSON = typer.Option(False, "--json", help="print the result as one JSON object")

stack_app = typer.Typer(
    no_args_is_help=True, help="The local embedded stack (Postgres + Kafka-compatible broker + vLLM servers)."
)


@stack_app.command("up")
def stack_up_cmd(
    partitions: int = typer.Option(None, help="partitions of the interactions topic"), as_json: bool = JSON
) -> None:
    """Start embedded Postgres and the broker (unless configured), create topics, migrate."""
    from app.core.migrate import upgrade
    from app.core.settings import get_settings
    from ops.stack import stack_up

    state = stack_up(partitions=partitions)
    get_settings.cache_clear()
    upgrade(url=state.database_url)
    if as_json:
        typer.echo(json.dumps({"postgres": state.database_url, "kafka": state.kafka_bootstrap}))
        return
    typer.echo(f"postgres {state.database_url}\nkafka    {state.kafka_bootstrap}")


@stack_app.command("serve")
def stack_serve_cmd(
    checkpoint: str = typer.Option(None, help="checkpoint to start on (default: production)"),
    wait: bool = typer.Option(True, "--wait/--no-wait", help="wait until both servers answer"),
    as_json: bool = JSON,
) -> None:
    """Start (or reuse) the managed vLLM servers, production and eval, and point the stack at them."""
    from app.core.settings import get_settings
    from ops.stack import serving_up
    from serving.engine import resolve_checkpoint

    cid, path = resolve_checkpoint(checkpoint, None)
    urls = serving_up(cid, path, wait=wait)
    get_settings.cache_clear()
    if as_json:
        typer.echo(json.dumps({"vllm": urls}))
        return
    typer.echo("\n".join(f"vllm {role:<10} {url}" for role, url in urls.items()))


@stack_app.command("down")
def stack_down_cmd(as_json: bool = JSON) -> None:
    """Stop only the processes the stack started."""
    from ops.stack import stack_down

    stopped = stack_down()
    if as_json:
        typer.echo(json.dumps({"stopped": stopped}))
        return
    typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing"))


@stack_app.command("status")
def stack_status_cmd(as_json: bool = JSON) -> None:
    """Health of Postgres, the broker and the managed vLLM servers (what each serves); exit 1 if one is down.
    With --json: ``{"healthy": bool, "services": {name: {"healthy": bool, ...}}}``."""
    from ops.stack import stack_status

    status = stack_status()
    healthy = all(s["healthy"] for s in status.values())
    if as_json:
        typer.echo(json.dumps({"healthy": healthy, "services": status}, default=str))
        raise typer.Exit(0 if healthy else 1)
    table = Table("service", "address", "pid", "healthy", "serves")
    for name, s in status.items():
        table.add_row(
            name,
            str(s.get("url") or s.get("bootstrap") or "-"),
            str(s.get("pid") or "external"),
            "[green]yes[/]" if s["healthy"] else "[red]no[/]",
            f"{s.get('weight_version') or '-'} ({s['dtype']})" if "dtype" in s else "",
        )
    Console().print(table)
    if not healthy:
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
    from app.worker.celery_app import celery_app

    argv = [
        "worker",
        f"--pool={pool or ('solo' if concurrency == 1 else 'prefork')}",
        f"--concurrency={concurrency}",
        f"--loglevel={loglevel}",
    ]
    if queues:
        argv.append(f"--queues={queues}")
    if beat:
        argv.append("--beat")
    celery_app.worker_main(argv)


def beat_cmd(loglevel: str = typer.Option("INFO", "--loglevel", "-l")) -> None:
    """Run the Celery beat scheduler (one per deployment; schedule in app/worker/schedule.py)."""
    from app.worker.celery_app import celery_app

    celery_app.start(["beat", f"--loglevel={loglevel}"])


@stack_app.command("topics")
def stack_topics_cmd(
    partitions: int = typer.Option(None, help="partitions of the interactions topic"), as_json: bool = JSON
) -> None:
    """Create flywheel's topics on the configured broker (production set-up; `stack up` does it locally)."""
    from app.core.settings import get_settings
    from ops.broker import create_topics

    kafka = get_settings().kafka
    if not kafka.bootstrap:
        raise ConfigurationError("set FLYWHEEL_KAFKA_BOOTSTRAP")
    created = create_topics(
        kafka.bootstrap,
        {kafka.interactions_topic: partitions or kafka.partitions, kafka.dlq_topic: 1, kafka.lifecycle_topic: 1},
    )
    if as_json:
        typer.echo(json.dumps({"created": created}))
        return
    typer.echo("created: " + (", ".join(created) if created else "nothing (all exist)"))


def up_cmd(
    services: list[str] = typer.Option(
        None, "--service", "-s", help="subset of consumer, worker, beat, api, relay, watcher"
    ),
    detach: bool = typer.Option(False, "--detach", "-d", help="start and return; `flywheel stack down` stops them"),
) -> None:
    """Run the loop's long-lived processes on the local stack so it turns by itself: consumers,
    Celery worker and beat (training every FLYWHEEL_TRAIN_INTERVAL seconds, the eval trigger),
    the API, the outbox relay and the serving watcher."""
    from app.core.migrate import upgrade
    from app.core.settings import flywheel_home, get_settings
    from ops.processes import LOOP_SERVICES, service_status, start_service
    from ops.stack import stack_down, stack_up

    unknown = set(services or ()) - set(LOOP_SERVICES)
    if unknown:
        raise typer.BadParameter(f"unknown service(s) {sorted(unknown)}; choose from {sorted(LOOP_SERVICES)}")
    con = Console()
    state = stack_up()
    get_settings.cache_clear()
    upgrade(url=state.database_url)
    home = flywheel_home()
    for name in services or LOOP_SERVICES:
        pid = start_service(name, LOOP_SERVICES[name], home)
        con.print(f"{name:9s} pid {pid}  log {home / 'logs' / (name + '.log')}")
    con.print(
        f"training every {get_settings().celery.train_interval:.0f}s (FLYWHEEL_TRAIN_INTERVAL); "
        f"API on http://{get_settings().api.host}:{get_settings().api.port}/"
    )
    if detach:
        return
    try:
        while True:
            time.sleep(5)
            dead = [n for n, (_, alive) in service_status(home).items() if not alive]
            if dead:
                con.print(f"[red]stopped unexpectedly: {', '.join(dead)}[/] (see logs); stopping the rest")
                break
    except KeyboardInterrupt:
        pass
    con.print("stopped: " + ", ".join(stack_down()))


def demo_cmd(
    cycles: int = typer.Option(
        3, help="full cycles (simulate -> consume -> train -> gate -> release -> measure) to run"
    ),
    sessions: int = typer.Option(16, help="simulated editor sessions per cycle (train tasks of --source)"),
    group_size: int = typer.Option(4, help="sessions per task (the trainer's groups)"),
    source: str = typer.Option("functions", help="task source of the simulated sessions (train split)"),
    difficulty_mix: str = typer.Option(
        None, help="request mix by task difficulty, LEVEL:WEIGHT pairs (default: '1:0.6,2:0.3,3:0.1'; 'none': uniform)"
    ),
    max_turns: int = typer.Option(3, help="agent turns per simulated session"),
    max_tokens_per_turn: int = typer.Option(160, help="completion tokens per turn"),
    max_steps: int = typer.Option(None, help="step budget of each training cycle (default: train on all it claims)"),
    trainer_config: str = typer.Option(None, help="trainer TOML (default trainer/configs/default.toml)"),
    eval_tasks: int = typer.Option(4, help="held-out tasks per eval suite (DataFrameBench test, HumanEval)"),
    eval_samples: int = typer.Option(1, help="samples per held-out task (suites with temperature > 0)"),
    eval_max_turns: int = typer.Option(2, help="agent turns per eval task"),
    suite: list[str] = typer.Option(
        None, "--suite", help="run the gate on these suites, which alone decide it (default: every gated suite)"
    ),
    model_dir: str = typer.Option(None, help="register this HF folder as the base model instead of SmolLM2"),
    trace: bool = typer.Option(False, "--trace", help="print OpenTelemetry spans (console exporter)"),
    engine: str = typer.Option(
        None, help="vllm: managed vLLM servers (default where vLLM is installed); torch: in-process engines"
    ),
    ab_tasks: int = typer.Option(24, min=0, help="fresh-traffic tasks of each cycle's curve point (0: none)"),
    ab_samples: int = typer.Option(2, min=1, help="sessions per fresh-traffic task and arm"),
    override_insufficient: str = typer.Option(
        None,
        help="promote a candidate whose gate found insufficient evidence, with this written reason "
        "(the release manager's audited override); default: such a candidate is rejected",
    ),
    seed: int = typer.Option(0),
    down: bool = typer.Option(False, "--down", help="stop everything the demo started, then exit"),
) -> None:
    """Run the whole loop on the embedded stack, --cycles times: simulate sessions, ingest, finalize,
    train, evaluate, gate, and promote or reject through the API; ends with a report and learning
    curves. Re-running picks up where an interrupted run stopped."""
    from ops.demo import DEFAULT_DIFFICULTY_MIX, DemoOptions, run_demo, stop_demo
    from serving.vllm_server import vllm_installed

    engine = engine or ("vllm" if vllm_installed() else "torch")
    if engine not in ("vllm", "torch"):
        raise typer.BadParameter(f"unknown engine {engine!r}; expected vllm or torch", param_hint="--engine")

    if down:
        stopped = stop_demo()
        typer.echo("stopped: " + (", ".join(stopped) if stopped else "nothing"))
        return
    run_demo(
        DemoOptions(
            cycles=cycles,
            sessions=sessions,
            group_size=group_size,
            source=source,
            difficulty_mix=None if difficulty_mix == "none" else (difficulty_mix or DEFAULT_DIFFICULTY_MIX),
            max_turns=max_turns,
            max_tokens_per_turn=max_tokens_per_turn,
            train_max_steps=max_steps,
            trainer_config=trainer_config,
            eval_tasks=eval_tasks,
            eval_suites=tuple(suite or ()),
            eval_samples=eval_samples,
            eval_max_turns=eval_max_turns,
            eval_max_tokens=max_tokens_per_turn,
            model_dir=model_dir,
            trace=trace,
            seed=seed,
            engine=engine,
            ab_tasks=ab_tasks,
            ab_samples=ab_samples,
            override_insufficient=override_insufficient,
        )
    )


def register(app: typer.Typer) -> None:
    """Add ``stack``, ``worker``, ``beat``, ``up`` and ``demo`` to the main app."""
    app.add_typer(stack_app, name="stack")
    app.command("worker")(worker_cmd)
    app.command("beat")(beat_cmd)
    app.command("up")(up_cmd)
    app.command("demo")(demo_cmd)

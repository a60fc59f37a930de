"""``flywheel stack``, ``worker``, ``beat``, ``up`` and ``demo``. Heavy imports stay inside commands."""

from __future__ import annotations

import json
import logging
import os
import time

import typer
from rich.console import Console
from rich.table import Table

from app.core.errors import ConfigurationError, InfrastructureError

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
    preflight: bool = typer.Option(
        True, help="check first that this process can build the graders' sandbox, and refuse to start if not"
    ),
) -> None:
    """Run a Celery worker for flywheel's tasks (training cycles, eval gating, outbox relay). It grades
    (gates, eval shards), so it starts only where the sandbox can be built (`flywheel eval sandbox-check`)."""
    from app.core.logs import configure_service_logging, use_json
    from app.core.settings import LogSettings
    from app.worker.celery_app import celery_app
    from evals.harness.sandbox_preflight import sandbox_preflight

    configure_service_logging(loglevel, service="flywheel-worker")
    if preflight:
        check = sandbox_preflight()
        if not check.ready:
            logging.getLogger("flywheel.sandbox").error("sandbox preflight: %s", check.message())
            raise InfrastructureError(check.message())
    argv = [
        *(["--quiet"] if use_json(LogSettings.load()) else []),  # no banner on a stream of JSON lines
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
    from app.core.logs import configure_service_logging, use_json
    from app.core.settings import LogSettings
    from app.worker.celery_app import celery_app

    configure_service_logging(loglevel, service="flywheel-beat")
    quiet = ["--quiet"] if use_json(LogSettings.load()) else []  # no banner on a stream of JSON lines
    celery_app.start([*quiet, "beat", f"--loglevel={loglevel}"])


@stack_app.command("broker")
def stack_broker_cmd(
    listen: str = typer.Option("127.0.0.1:9092", help="host:port the broker listens on"),
    advertise: str = typer.Option(None, help="host:port clients are told to connect to (default: --listen)"),
) -> None:
    """Run the Kafka-protocol broker of the embedded stack (tansu, memory storage) in the foreground:
    the broker of compose's stand-in images on hosts that cannot pull Apache Kafka's. What it holds
    is lost when it stops (Postgres is the durable record)."""
    from ops.broker import broker_argv

    argv = broker_argv(listen, advertise or listen)
    os.execv(argv[0], argv)


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
        None, "--service", "-s", help="subset of consumer, api, relay, watcher, front, worker, beat (default: all)"
    ),
    detach: bool = typer.Option(
        False, "--detach", "-d", help="start, supervise in the background and return; `flywheel stack down` stops all"
    ),
    serving: bool = typer.Option(
        None, "--serving/--no-serving", help="start the managed vLLM servers (default: where vLLM is installed)"
    ),
    supervise: bool = typer.Option(False, "--supervise", hidden=True, help="the background supervisor of `up -d`"),
) -> None:
    """Run the deployed loop on this machine so it turns by itself: the stack, production on the
    managed vLLM servers, the consumer, the API, the outbox relay, the serving watcher, the serving
    front (the product backend's endpoint, FLYWHEEL_FRONT_URL), and the Celery worker and beat (a training cycle every FLYWHEEL_TRAIN_INTERVAL seconds or once
    FLYWHEEL_TRAIN_READY_TRAJECTORIES are waiting; each candidate gated; FLYWHEEL_RELEASE_POLICY
    promotes or holds it). A process that keeps dying stops the loop with exit code 1."""
    from app.core.settings import flywheel_home, get_settings
    from ops.stack import stack_down
    from ops.up import bring_up, detach_supervisor, loop_services, start_loop

    try:
        chosen = loop_services(services)
    except ValueError as exc:
        raise typer.BadParameter(str(exc), param_hint="--service") from None
    con = Console()
    home = flywheel_home()
    env = dict(os.environ)
    if supervise:  # the background half of `up -d`: the stack is up; start and watch the services
        supervisor = start_loop(home, chosen, env, on_event=con.print)
        raise typer.Exit(supervisor.run())
    up = bring_up(home, serving=serving, on_event=con.print)
    if not up.serving_urls:  # no managed servers: nothing for the front to send requests to
        chosen.pop("front", None)
    con.print(f"postgres {up.database_url}\nkafka    {up.kafka_bootstrap}\nproduction {up.production_id}")
    for role, url in up.serving_urls.items():
        con.print(f"vllm {role:<10} {url}")
    if up.front_url:
        con.print(f"front      {up.front_url}  (the product backend's endpoint)")
    celery = get_settings().celery
    con.print(
        f"training every {celery.train_interval:.0f}s (FLYWHEEL_TRAIN_INTERVAL)"
        + (f" or once {celery.train_ready_trajectories} trajectories wait" if celery.train_ready_trajectories else "")
        + f"; API on {up.api_url}/"
    )
    if detach:
        pid = detach_supervisor(home, list(chosen), env)
        con.print(f"supervisor pid {pid}  log {home / 'logs' / 'supervisor.log'}")
        _wait_detached(home, chosen, pid)
        con.print("the loop is up; `flywheel stack status` shows it, `flywheel stack down` stops it")
        return
    try:
        supervisor = start_loop(home, chosen, env, on_event=con.print)
        code = supervisor.run()
    finally:
        con.print("stopped: " + ", ".join(stack_down()))
    raise typer.Exit(code)


def _wait_detached(home, services: dict[str, list[str]], supervisor_pid: int, timeout_s: float = 900.0) -> None:
    """Wait until every service of a detached ``up`` runs (the vLLM servers' warm-up included).

    Raises:
        InfrastructureError: the supervisor exited, or the services were not all up in time.
    """
    from app.core.errors import InfrastructureError
    from app.core.pids import pid_alive
    from app.core.settings import get_settings
    from ops.processes import service_status, wait_http

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(supervisor_pid):
            raise InfrastructureError(f"the loop's supervisor exited; see {home / 'logs' / 'supervisor.log'}")
        status = service_status(home)
        if all(status.get(n, (None, False))[1] for n in services):
            if "api" in services:
                api = get_settings().api
                wait_http(f"{api.url or f'http://{api.host}:{api.port}'}/healthz", timeout_s=120.0)
            return
        time.sleep(1.0)
    raise InfrastructureError(f"the loop's services were not all up after {timeout_s:.0f}s; see {home / 'logs'}")


def demo_cmd(
    cycles: int = typer.Option(3, help="cycles of the loop to drive (traffic -> train -> gate -> release -> measure)"),
    sessions: int = typer.Option(16, help="simulated editor sessions per cycle (train tasks of --source)"),
    group_size: int = typer.Option(4, help="sessions per task (the trainer's groups)"),
    source: str = typer.Option("functions", help="task source of the simulated sessions (train split)"),
    difficulty_mix: str = typer.Option(
        None, help="request mix by task difficulty, LEVEL:WEIGHT pairs (default: '1:0.6,2:0.3,3:0.1'; 'none': uniform)"
    ),
    max_turns: int = typer.Option(3, help="agent turns per simulated session"),
    max_tokens_per_turn: int = typer.Option(160, help="completion tokens per turn"),
    long_sessions: float = typer.Option(
        0.0,
        min=0.0,
        max=1.0,
        help="share of each cycle's task groups played as long functions_long sessions, which self-summarize "
        "(at least 4 turns; the trainer then keeps segments that long); the fresh-traffic A/B stays on --source",
    ),
    max_steps: int = typer.Option(None, help="step budget of each training cycle (default: train on all it claims)"),
    trainer_config: str = typer.Option(
        None, help="trainer TOML of the loop's cycles (default trainer/configs/default.toml)"
    ),
    eval_tasks: int = typer.Option(None, min=1, help="held-out tasks per gated suite (default: the whole suite)"),
    eval_max_turns: int = typer.Option(2, help="agent turns per eval task"),
    suite: list[str] = typer.Option(None, "--suite", help="suites the gate runs and decides on (default: functions)"),
    gate_config: str = typer.Option(None, help="gate policy TOML of the loop (default evals/gate.toml)"),
    gate_samples: int = typer.Option(
        None,
        min=1,
        help="k of the held-out gate (default: the policy's, 8): fewer fits a short demo and is reported UNDERPOWERED",
    ),
    model_dir: str = typer.Option(None, help="register this HF folder as the base model instead of SmolLM2"),
    trace: bool = typer.Option(False, "--trace", help="print OpenTelemetry spans (console exporter)"),
    ab_tasks: int = typer.Option(24, min=0, help="fresh-traffic tasks of each cycle's curve point (0: none)"),
    ab_samples: int = typer.Option(2, min=1, help="sessions per fresh-traffic task and arm"),
    release_policy: str = typer.Option(
        "auto_on_pass", help="the loop's release policy: auto_on_pass (promote what the gate passes) or manual"
    ),
    override_insufficient: str = typer.Option(
        None,
        help="the release policy also promotes a candidate whose gate found insufficient evidence, with this "
        "written reason (audited); default: such a candidate is held",
    ),
    placebo: bool = typer.Option(
        False, "--placebo", help="shuffle each cycle's rewards within each task group (a control)"
    ),
    placebo_mode: str = typer.Option(
        "within_group", help="how --placebo shuffles: within_group (each group keeps its rewards) or across_cycle"
    ),
    keeps_wrong_rate: float = typer.Option(
        0.0, min=0.0, max=1.0, help="the training traffic's developer keeps this share of plausible wrong edits"
    ),
    untested_rate: float = typer.Option(
        0.0, min=0.0, max=1.0, help="share of training sessions whose tests the developer never runs"
    ),
    signal_loss_rate: float = typer.Option(
        0.0, min=0.0, max=1.0, help="share of the training traffic's late signals that never arrive"
    ),
    cycle_timeout: float = typer.Option(1800.0, min=1, help="seconds to wait for the loop to decide one cycle"),
    seed: int = typer.Option(0),
    down: bool = typer.Option(False, "--down", help="stop everything the demo started, then exit"),
) -> None:
    """Drive the deployed loop (`flywheel up`) on the embedded stack for --cycles cycles: simulated
    product traffic in, then the loop trains, gates and releases by itself; each served checkpoint is
    measured on fresh traffic; ends with a report and learning curves. Re-running picks up where an
    interrupted run stopped."""
    from ops.demo import DEFAULT_DIFFICULTY_MIX, DemoOptions, run_demo, stop_demo
    from ops.developer import DeveloperModel

    if release_policy not in ("auto_on_pass", "manual"):
        raise typer.BadParameter(f"unknown release policy {release_policy!r}", param_hint="--release-policy")
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
            long_session_share=long_sessions,
            train_max_steps=max_steps,
            trainer_config=trainer_config,
            eval_tasks=eval_tasks,
            eval_suites=tuple(suite or ("functions",)),
            gate_config=gate_config,
            gate_samples=gate_samples,
            eval_max_turns=eval_max_turns,
            eval_max_tokens=max_tokens_per_turn,
            model_dir=model_dir,
            trace=trace,
            seed=seed,
            ab_tasks=ab_tasks,
            ab_samples=ab_samples,
            release_policy=release_policy,
            override_insufficient=override_insufficient,
            cycle_timeout_s=cycle_timeout,
            placebo=placebo_mode if placebo else None,
            developer=DeveloperModel(
                keeps_wrong_rate=keeps_wrong_rate, untested_rate=untested_rate, signal_loss_rate=signal_loss_rate
            ),
        )
    )


def register(app: typer.Typer) -> None:
    """Add ``stack``, ``worker``, ``beat``, ``up`` and ``demo`` to the main app."""
    app.add_typer(stack_app, name="stack")
    app.command("worker")(worker_cmd)
    app.command("beat")(beat_cmd)
    app.command("up")(up_cmd)
    app.command("demo")(demo_cmd)

"""``flywheel up``: the deployed loop on one machine, started and supervised.

What it starts, in order: the local stack where none is configured (embedded Postgres, the tansu
broker, topics, migrations), the base model as production where there is none, the managed vLLM
servers (production traffic, evals; ``serving.vllm_server``) where vLLM is installed, then the loop's
processes (``ops.processes.LOOP_SERVICES``): the consumer, the API and the outbox relay at once, the
serving watcher, the serving front (``flywheel front``: the product backend's one endpoint), the
Celery worker and beat once the servers answer. Beat starts training cycles, the
worker gates each candidate and applies the release policy (``FLYWHEEL_RELEASE_POLICY``), the relay
publishes lifecycle messages and the watcher moves the production server to what the database says
is production. Nobody needs to be at the keyboard for a cycle to run.

Invariants: every setting a process needs is in ``$FLYWHEEL_HOME/stack.env`` (the vLLM servers'
URLs and ``FLYWHEEL_SERVING_ENGINE=vllm`` included) before that process starts, so a restarted
service reads the same; and what ``up`` starts, ``flywheel stack down`` stops, by pid.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from app.checkpoints.publish import init_base
from app.core.db import session_scope
from app.core.errors import InfrastructureError, NotFoundError
from app.core.migrate import upgrade
from app.core.settings import flywheel_home, get_settings
from app.repositories.checkpoints import get_production
from app.repositories.tokens import authenticate, create_token, revoke_token
from ops.processes import (
    LOOP_SERVICES,
    SERVING_CLIENTS,
    SUPERVISOR,
    Supervisor,
    service_env,
    start_service,
    wait_http,
)
from ops.stack import StackState, serving_up, serving_wait, stack_up
from serving.engine import resolve_checkpoint
from serving.vllm_server import vllm_installed


@dataclass(frozen=True)
class LoopUp:
    """What :func:`bring_up` found or started."""

    database_url: str
    kafka_bootstrap: str
    production_id: str
    serving_urls: dict[str, str]
    front_url: str | None
    api_url: str


def ensure_production(on_event: Callable[[str], None]) -> str:
    """The production checkpoint's id; the base model is materialized and registered as production
    when the registry has none (``flywheel model init``)."""
    with session_scope() as session:
        prod = get_production(session)
        if prod is not None:
            return prod.id
    on_event("no production checkpoint: materializing the base model (flywheel model init)")
    init_base()
    with session_scope() as session:
        production = get_production(session)
        if production is None:
            raise InfrastructureError("flywheel model init made no production checkpoint")
        return production.id


FRONT_TOKEN_NAME = "flywheel-up"
"""The inference token ``flywheel up`` holds for its own clients of the front (the demo's simulated
product backend): ``FLYWHEEL_FRONT_API_KEY`` in ``stack.env``."""


def ensure_front_key(home: Path) -> str:
    """The stack's inference token for the serving front, created (audited, actor ``flywheel up``)
    where ``stack.env`` holds none that authenticates (first start, a new database, a revoked key),
    and saved in the stack's state (owner-only file).

    Raises:
        InfrastructureError: no stack state under ``home`` (``stack_up`` runs first).
    """
    state = StackState.load(home)
    if state is None:
        raise InfrastructureError(f"no stack state under {home}: start the stack first")
    with session_scope() as session:
        if state.front_api_key and authenticate(session, state.front_api_key) is not None:
            return state.front_api_key
        try:  # a live token of that name whose plaintext this stack lost: replace it
            revoke_token(session, FRONT_TOKEN_NAME, actor="flywheel up")
        except NotFoundError:
            pass
        _, raw = create_token(session, name=FRONT_TOKEN_NAME, role="inference", actor="flywheel up")
    state.front_api_key = raw
    state.save(home)
    return raw


def bring_up(
    home: Path | None = None, *, serving: bool | None = None, on_event: Callable[[str], None] = print
) -> LoopUp:
    """Start (or reuse) the stack, production and the managed vLLM servers (warming up, not awaited).

    Args:
        home: ``$FLYWHEEL_HOME`` (default from settings).
        serving: start the managed vLLM servers (default: where vLLM is installed).
        on_event: where progress lines go.

    Raises:
        ConfigurationError: vLLM asked for and not installed.
        InfrastructureError: Postgres or the broker did not come up.
    """
    home = home or flywheel_home()
    state = stack_up(home)
    get_settings.cache_clear()
    upgrade(url=state.database_url)
    production_id = ensure_production(on_event)
    urls: dict[str, str] = {}
    if serving if serving is not None else vllm_installed():
        cid, path = resolve_checkpoint(production_id, None)
        urls = serving_up(cid, path, home, wait=False)
        ensure_front_key(home)
    get_settings.cache_clear()
    api = get_settings().api
    front_port = (StackState.load(home) or state).front_port if urls else None
    return LoopUp(
        database_url=state.database_url,
        kafka_bootstrap=state.kafka_bootstrap,
        production_id=production_id,
        serving_urls=urls,
        front_url=f"http://127.0.0.1:{front_port}" if front_port else None,
        api_url=api.url or f"http://{api.host}:{api.port}",
    )


def start_loop(
    home: Path, services: dict[str, list[str]], env: dict[str, str], *, on_event: Callable[[str], None] = print
) -> Supervisor:
    """Start the loop's services under a :class:`~ops.processes.Supervisor`: those that need no
    server first, then (once the managed vLLM servers answer) those that call them.

    Raises:
        InfrastructureError: a vLLM server or the API did not come up.
    """
    supervisor = Supervisor(home, services, env, on_event=on_event)
    ports = {n: service_env(n, env).get("FLYWHEEL_METRICS_PORT") for n in services}
    if env.get("FLYWHEEL_METRICS_PORT"):
        write_prometheus_targets(home, {n: int(p) for n, p in ports.items() if p})

    def started(name: str, pid: int) -> None:
        metrics = f"  metrics :{ports[name]}" if ports.get(name) else ""
        on_event(f"{name:9s} pid {pid}  log {home / 'logs' / (name + '.log')}{metrics}")

    first = [n for n in services if n not in SERVING_CLIENTS]
    for name, pid in supervisor.start(first).items():
        started(name, pid)
    state = StackState.load(home)
    if state is not None and state.serving_urls:
        on_event("waiting for the vLLM servers: " + ", ".join(f"{r} {u}" for r, u in state.serving_urls.items()))
        serving_wait(home)
    for name, pid in supervisor.start([n for n in services if n in SERVING_CLIENTS]).items():
        started(name, pid)
    if "api" in services:
        api = get_settings().api
        wait_http(f"{api.url or f'http://{api.host}:{api.port}'}/healthz")
    return supervisor


def write_prometheus_targets(home: Path, ports: dict[str, int], host: str = "127.0.0.1") -> Path:
    """Write ``$FLYWHEEL_HOME/prometheus_targets.json``, the loop's ``/metrics`` endpoints (service ->
    port) in Prometheus' ``file_sd_configs`` format (one target per service, labelled ``service``).
    Returns its path."""
    targets = [
        {"targets": [f"{host}:{port}"], "labels": {"job": "flywheel", "service": name}} for name, port in ports.items()
    ]
    path = home / "prometheus_targets.json"
    path.write_text(json.dumps(targets, indent=2) + "\n")
    return path


def detach_supervisor(home: Path, services: list[str], env: dict[str, str]) -> int:
    """Run the supervisor (``flywheel up --supervise``) in the background; returns its pid. It is
    recorded with the stack, so ``flywheel stack down`` stops it (and, through it, the services)."""
    args = ["up", "--supervise", *(a for s in services for a in ("--service", s))]
    return start_service(SUPERVISOR, args, home, env)


def loop_services(names: list[str] | None) -> dict[str, list[str]]:
    """The named loop services (default all), in start order.

    Raises:
        ValueError: an unknown name.
    """
    unknown = set(names or ()) - set(LOOP_SERVICES)
    if unknown:
        raise ValueError(f"unknown service(s) {sorted(unknown)}; choose from {sorted(LOOP_SERVICES)}")
    return {n: a for n, a in LOOP_SERVICES.items() if not names or n in names}

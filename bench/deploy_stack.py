"""The compose deploy as ``bench/deploy.py`` drives it: Docker Compose v2 over ``ops/deploy/compose.yaml``
with ``compose.local.yaml`` (stand-in images, host networking on loopback) and a bench override that
compresses the loop's schedule, plus read-outs from the deploy's own Postgres.

Invariant: every address used is on loopback (the services' own 127.0.0.x, compose.local.yaml);
nothing here routes traffic elsewhere. A crash is a SIGKILL of a container's main process from the
host, which Docker answers with the service's restart policy (``docker kill`` is a manual stop to
Docker 20.10, which no restart policy follows).
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import psycopg

REPO = Path(__file__).resolve().parents[1]
DEPLOY = REPO / "ops" / "deploy"
ADDRESS = {  # compose.local.yaml's loopback address of each service
    "postgres": "127.0.0.2",
    "vllm": "127.0.0.5",
    "vllm-eval": "127.0.0.6",
    "vllm-canary": "127.0.0.7",
    "api": "127.0.0.8",
    "front": "127.0.0.9",
}


def compose_v2() -> list[str] | None:
    """The Compose v2 command (``docker compose``), or None where Docker or Compose v2 is missing."""
    docker = shutil.which("docker")
    if docker is None:
        return None
    try:
        out = subprocess.run([docker, "compose", "version"], capture_output=True, text=True, timeout=30)
        info = subprocess.run([docker, "info"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    if out.returncode != 0 or info.returncode != 0 or " v1." in out.stdout or "version 1." in out.stdout:
        return None
    return [docker, "compose"]


def wait_for(predicate: Callable[[], Any], timeout_s: float, what: str, interval_s: float = 2.0) -> Any:
    """Poll ``predicate`` until it returns something truthy; that value.

    Raises:
        TimeoutError: ``timeout_s`` seconds passed first (naming ``what``).
    """
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            value = predicate()
        except (httpx.HTTPError, psycopg.Error, OSError):
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f} s waiting for {what}")
        time.sleep(interval_s)


@dataclass
class Deploy:
    """One compose project of the bench: its secrets, its files, and the calls the bench makes."""

    project: str
    workdir: Path
    compose: list[str]
    env: dict[str, str] = field(default_factory=dict)

    @classmethod
    def create(cls, project: str, workdir: Path, compose: list[str], settings: dict[str, str], trainer_toml: str):
        """Secrets generated for this run, the bench override written under ``workdir``."""
        workdir.mkdir(parents=True, exist_ok=True)
        keys = {
            "POSTGRES_PASSWORD": secrets.token_urlsafe(24),
            "FLYWHEEL_SERVING_API_KEY": secrets.token_urlsafe(32),
            "FLYWHEEL_SERVING_ADMIN_KEY": secrets.token_urlsafe(32),
            "FLYWHEEL_SERVING_EVAL_ADMIN_KEY": secrets.token_urlsafe(32),
        }
        settings = dict(settings)
        dtype = settings.pop("_dtype", "float32")
        (workdir / "trainer.toml").write_text(trainer_toml)
        os.chmod(workdir, 0o755)
        os.chmod(workdir / "trainer.toml", 0o644)
        override = {"services": {}}
        for name in ("consumer", "worker", "eval-worker", "beat", "relay", "watcher", "api", "front", "migrate"):
            service: dict[str, Any] = {"environment": dict(settings)}
            if name in ("worker", "eval-worker"):
                service["volumes"] = [f"{workdir / 'trainer.toml'}:/etc/flywheel/trainer.toml:ro"]
                service["environment"]["FLYWHEEL_TRAIN_CONFIG"] = "/etc/flywheel/trainer.toml"
            override["services"][name] = service
        (workdir / "compose.bench.yaml").write_text(json.dumps(override, indent=2))
        keys["FLYWHEEL_VLLM_DTYPE"] = dtype
        keys["FLYWHEEL_VLLM_CPUS"] = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
        env_file = workdir / "deploy.env"  # what an operator needs to reach a kept deploy (owner only)
        env_file.touch(mode=0o600)
        env_file.write_text("".join(f"{k}={v}\n" for k, v in keys.items()))
        return cls(project, workdir, compose, {**os.environ, **keys})

    def command_line(self) -> str:
        """The compose command an operator types to reach this deploy (``... ps``, ``... down -v``)."""
        files = " ".join(self.files())
        return f"cd {DEPLOY} && docker compose -p {self.project} --env-file {self.workdir / 'deploy.env'} {files}"

    def files(self) -> list[str]:
        return ["-f", "compose.yaml", "-f", "compose.local.yaml", "-f", str(self.workdir / "compose.bench.yaml")]

    def run(self, *args: str, timeout_s: float = 900, check: bool = True) -> subprocess.CompletedProcess[str]:
        """``docker compose -p PROJECT -f ... ARGS`` in ops/deploy (seccomp-sandbox.json is relative to it).

        Raises:
            RuntimeError: a non-zero exit with ``check`` (its stderr's tail).
        """
        cmd = [*self.compose, "-p", self.project, *self.files(), *args]
        out = subprocess.run(cmd, cwd=DEPLOY, env=self.env, capture_output=True, text=True, timeout=timeout_s)
        if check and out.returncode != 0:
            raise RuntimeError(f"{' '.join(args[:3])}: exit {out.returncode}: {(out.stderr or out.stdout)[-2000:]}")
        return out

    def flywheel(
        self, *args: str, env: dict[str, str] | None = None, timeout_s: float = 1800, service: str = "api"
    ) -> str:
        """``flywheel ARGS`` in a one-off container of ``service`` (its settings, the deploy's network
        and volumes): the API's is the operator's seat; a grader's (``worker``) has the sandbox's grants."""
        extra = [x for k, v in (env or {}).items() for x in ("-e", f"{k}={v}")]
        return self.run("run", "--rm", "--no-deps", "-T", *extra, service, *args, timeout_s=timeout_s).stdout

    def container(self, service: str) -> str:
        """The id of the service's (first) container."""
        ids = self.run("ps", "-q", service).stdout.split()
        if not ids:
            raise RuntimeError(f"no container for {service}")
        return ids[0]

    def inspect(self, service: str) -> dict[str, Any]:
        out = subprocess.run(
            ["docker", "inspect", self.container(service)], capture_output=True, text=True, timeout=30, check=True
        )
        return json.loads(out.stdout)[0]

    def crash(self, service: str) -> int:
        """SIGKILL the service's main process from the host (a crash); its restart count before."""
        state = self.inspect(service)
        os.kill(int(state["State"]["Pid"]), signal.SIGKILL)
        return int(state["RestartCount"])

    def restarted(self, service: str, before: int) -> bool:
        """Whether Docker restarted the service after a crash and it is running again."""
        state = self.inspect(service)
        return int(state["RestartCount"]) > before and bool(state["State"]["Running"])

    def logs(self, service: str, tail: int = 60) -> str:
        return self.run("logs", "--no-color", "--tail", str(tail), service, check=False).stdout

    def db(self) -> psycopg.Connection:
        """A connection to the deploy's Postgres (autocommit, as the flywheel role)."""
        password = self.env["POSTGRES_PASSWORD"]
        url = f"postgresql://flywheel:{password}@{ADDRESS['postgres']}:5432/flywheel"
        return psycopg.connect(url, autocommit=True, connect_timeout=5)

    def query(self, sql: str, *params: Any) -> list[tuple]:
        with self.db() as conn:
            return conn.execute(sql, params).fetchall()

    def served(self, service: str = "vllm") -> str | None:
        """The checkpoint a vLLM server reports it serves (``/weight_info``, the inference key)."""
        key = self.env["FLYWHEEL_SERVING_API_KEY"]
        r = httpx.get(
            f"http://{ADDRESS[service]}:8000/weight_info", headers={"Authorization": f"Bearer {key}"}, timeout=10
        )
        return r.json().get("weight_version") if r.status_code == 200 else None

    def production(self) -> str | None:
        rows = self.query("SELECT id FROM checkpoint WHERE status = 'production'")
        return rows[0][0] if rows else None

    def served_matches_db(self) -> bool:
        prod = self.production()
        return prod is not None and self.served() == prod

    def healthy(self, service: str, path: str, port: int) -> bool:
        return httpx.get(f"http://{ADDRESS[service]}:{port}{path}", timeout=5).status_code == 200

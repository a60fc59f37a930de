"""Network probes shared by the local stack, health checks and tests: free ports, TCP reachability
and a Kafka metadata round trip."""

from __future__ import annotations

import socket

from kafka import KafkaAdminClient

from producers.settings import kafka_client_options


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    """Whether something accepts TCP connections on ``host:port``."""
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def broker_healthy(bootstrap: str, timeout_s: float = 5.0) -> bool:
    """Whether the broker answers a Kafka metadata request."""
    try:
        admin = KafkaAdminClient(
            bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **kafka_client_options()
        )
    except Exception:  # kafka-python raises several types for "not there yet"
        return False
    try:
        admin.list_topics()
        return True
    except Exception:
        return False
    finally:
        admin.close()

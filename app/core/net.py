"""Network probes shared by the local stack, health checks and tests: free ports, TCP reachability,
a Kafka metadata round trip, and what a vLLM server says it serves."""

from __future__ import annotations

import socket

import httpx
from kafka import KafkaAdminClient

from producers.settings import kafka_security


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free on ``host`` right now."""
    with socket.socket() as s:
        s.bind((host, 0))
        port: int = s.getsockname()[1]
        return port


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
            bootstrap_servers=bootstrap, request_timeout_ms=int(timeout_s * 1000), **kafka_security()
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


def served_weight_version(url: str, *, api_key: str | None = None, timeout_s: float = 3.0) -> str | None:
    """The checkpoint a vLLM server reports it serves (``GET url/weight_info`` -> ``weight_version``),
    or None when the server does not answer or reports none. Read from the server, never assumed:
    a reload that returned success but changed nothing shows here (vLLM #32718).

    Args:
        url: the server's base URL (with or without a trailing ``/v1``).
        api_key: sent as a bearer token where the server requires one.
        timeout_s: seconds to wait for the answer.
    """
    base = url.rstrip("/").removesuffix("/v1")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        resp = httpx.get(f"{base}/weight_info", headers=headers, timeout=timeout_s)
        version = resp.json().get("weight_version") if resp.status_code == 200 else None
    except (httpx.HTTPError, ValueError, AttributeError):
        return None
    return str(version) if version else None

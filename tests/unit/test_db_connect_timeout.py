"""A database server that accepts the TCP connection but never answers (a network partition, a hung
server) fails the connection attempt after ``FLYWHEEL_DATABASE_CONNECT_TIMEOUT_S``: the callers'
retries (the consumer's rebalance callback gives up after half the group's session timeout) depend on it."""

from __future__ import annotations

import socket
import threading
import time

import pytest
from sqlalchemy import exc, text


@pytest.fixture
def silent_server():
    """A listening socket that never accepts: the kernel completes the handshake, nothing answers."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        yield s.getsockname()[1]


def test_a_server_that_never_answers_fails_the_connection_within_the_timeout(silent_server, monkeypatch):
    from app.core.db import get_engine, reset_engines
    from app.core.settings import get_settings

    monkeypatch.setenv("FLYWHEEL_DATABASE_URL", f"postgresql://flywheel@127.0.0.1:{silent_server}/flywheel")
    monkeypatch.setenv("FLYWHEEL_DATABASE_CONNECT_TIMEOUT_S", "2")
    get_settings.cache_clear()
    reset_engines()
    outcome: list = []

    def connect() -> None:
        started = time.monotonic()
        try:
            with get_engine().connect() as conn:
                conn.execute(text("SELECT 1"))
        except exc.OperationalError as e:
            outcome.append((time.monotonic() - started, e))

    try:
        t = threading.Thread(target=connect, daemon=True)
        t.start()
        t.join(20)
        assert not t.is_alive(), "the connection attempt hung past 20 s"
        assert outcome and 1.5 <= outcome[0][0] < 10, outcome
        assert "timeout" in str(outcome[0][1]).lower()
    finally:
        reset_engines()
        get_settings.cache_clear()

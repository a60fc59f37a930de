"""Kafka TLS/SASL settings: every flywheel client takes them from ``FLYWHEEL_KAFKA_*``, the password
is never shown, and the producer SDK against a broker that requires SASL authentication (tansu 0.6
with ``--authentication``) and wrong credentials reports a clear error naming the settings (not the
password) and loses nothing: the events stay spooled and go out once a broker takes them."""

from __future__ import annotations

import subprocess
import threading
import time

import pytest
from kafka.errors import KafkaError
from pydantic import ValidationError

from app.core.net import broker_healthy, free_port, port_open
from app.core.pids import stop_pid
from consumers.kafka_client import GroupClient
from consumers.settings import ConsumerSettings
from consumers.testing import generate_stream
from ops.broker import create_topics, start_broker, tansu_path
from producers.errors import BrokerUnavailableError
from producers.producer import EventProducer
from producers.settings import KafkaSettings, kafka_security
from tests.fixtures.broker import read_topic

pytestmark = pytest.mark.integration

PASSWORD = "not-the-password-3c9e1f"
SASL_ENV = {
    "FLYWHEEL_KAFKA_SECURITY_PROTOCOL": "SASL_PLAINTEXT",
    "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-512",
    "FLYWHEEL_KAFKA_SASL_PLAIN_USERNAME": "alice",
    "FLYWHEEL_KAFKA_SASL_PLAIN_PASSWORD": PASSWORD,
}


def test_settings_are_complete_and_never_show_the_password(monkeypatch):
    for k, v in SASL_ENV.items():
        monkeypatch.setenv(k, v)
    s = KafkaSettings()
    assert PASSWORD not in repr(s) and PASSWORD not in s.security_summary() and PASSWORD not in str(s.model_dump())
    assert kafka_security() == {
        "security_protocol": "SASL_PLAINTEXT",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "alice",
        "sasl_plain_password": PASSWORD,
    }
    monkeypatch.delenv("FLYWHEEL_KAFKA_SASL_PLAIN_PASSWORD")
    with pytest.raises(ValidationError, match="FLYWHEEL_KAFKA_SASL_PLAIN_PASSWORD"):
        KafkaSettings()
    assert KafkaSettings(security_protocol="PLAINTEXT", sasl_mechanism=None).security_config() == {
        "security_protocol": "PLAINTEXT"
    }


@pytest.fixture
def sasl_broker(tmp_path):
    """A tansu broker that requires SASL authentication (it holds no user: every login fails)."""
    port = free_port()
    log = open(tmp_path / "tansu-sasl.log", "ab")
    proc = subprocess.Popen(
        [str(tansu_path()), "broker", "--listener-url", f"tcp://127.0.0.1:{port}", "--advertised-listener-url",
         f"tcp://127.0.0.1:{port}", "--storage-engine", "memory://tansu/", "--authentication"],
        stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    deadline = time.monotonic() + 20
    while not port_open("127.0.0.1", port) and time.monotonic() < deadline:
        time.sleep(0.1)
    try:
        yield f"127.0.0.1:{port}"
    finally:
        stop_pid(proc.pid)
        log.close()


def test_wrong_credentials_give_a_clear_error_and_the_sdk_spools(sasl_broker, tmp_path, monkeypatch, caplog):
    for k, v in SASL_ENV.items():
        monkeypatch.setenv(k, v)
    events = generate_stream(12, seed=5)
    errors: list[Exception] = []
    spool = tmp_path / "spool"
    with caplog.at_level("DEBUG"):
        producer = EventProducer(
            sasl_broker,
            "interactions",
            spool_dir=spool,
            on_error=lambda exc, ev: errors.append(exc),
            delivery_timeout_s=2.0,
            connect_timeout_s=2.0,
        )
        for e in events:
            producer.emit(e)
        producer.flush(timeout_s=20)
        m = producer.metrics
        producer.close(timeout_s=5)
    assert m["sent"] == 0 and m["spool_pending"] == len(events) and m["broker_down"] == 1
    refused = [e for e in errors if isinstance(e, BrokerUnavailableError)]
    assert refused and "SCRAM-SHA-512 as 'alice'" in str(refused[0])
    assert "FLYWHEEL_KAFKA_SASL_PLAIN_PASSWORD" in str(refused[0])
    assert PASSWORD not in caplog.text and all(PASSWORD not in str(e) for e in errors)
    assert _scram_exchange_began(caplog.text, "SCRAM-SHA-512", "alice")  # the SDK logged in with the settings

    # nothing lost: a broker that takes the producer (here a plain one) receives every spooled event
    for k in SASL_ENV:
        monkeypatch.delenv(k)
    broker = start_broker(tmp_path / "plain")
    try:
        create_topics(broker.bootstrap, {"interactions": 1})
        with EventProducer(broker.bootstrap, "interactions", spool_dir=spool) as again:
            again.flush(timeout_s=30)
        got = {r.key for r in read_topic(broker.bootstrap, "interactions", idle_ms=1500)}
        assert len(list(read_topic(broker.bootstrap, "interactions", idle_ms=1500))) == len(events)
        assert got == {e.session_id.encode() for e in events}
    finally:
        stop_pid(broker.pid)


SCRAM_256_ENV = {**SASL_ENV, "FLYWHEEL_KAFKA_SASL_MECHANISM": "SCRAM-SHA-256"}


def _scram_exchange_began(log: str, mechanism: str, user: str) -> bool:
    """Whether kafka-python's DEBUG log shows a SCRAM login of ``user`` with ``mechanism``: the
    SASL handshake naming the mechanism and the client-first message ``n,,n=<user>,r=<nonce>``
    (RFC 5802 section 5.1), answered by the broker's ``e=unknown-user``."""
    return (
        f"SaslHandshakeRequest(version=1, mechanism='{mechanism}')" in log
        and f"auth_bytes=b'n,,n={user},r=" in log
        and "auth_bytes=b'e=unknown-user'" in log
    )


def test_scram_sha_256_from_settings_reaches_the_kafka_clients(sasl_broker, monkeypatch, caplog):
    """No broker here can hold a SCRAM user while it requires authentication (docs/operations.md,
    "Kafka security"), so no login succeeds; what is tested is that the settings reach kafka-python
    in the admin client (health checks, topic creation) and the ingest consumer: each starts a real
    SCRAM-SHA-256 exchange as the configured user, which tansu refuses, and neither comes up."""
    for k, v in SCRAM_256_ENV.items():
        monkeypatch.setenv(k, v)
    with caplog.at_level("DEBUG", logger="kafka"):
        assert broker_healthy(sasl_broker, timeout_s=2.0) is False
    assert _scram_exchange_began(caplog.text, "SCRAM-SHA-256", "alice")
    caplog.clear()

    member = GroupClient(
        bootstrap=sasl_broker,
        topic="interactions",
        group_id="g",
        client_id="c",
        max_event_bytes=1_000_000,
        settings=ConsumerSettings(bootstrap_timeout_ms=2000),
        stop=threading.Event(),
        abort=threading.Event(),
        drain=lambda timeout_s: None,
    )
    with caplog.at_level("DEBUG", logger="kafka"), pytest.raises(KafkaError):  # the bootstrap timed out
        member.new_consumer()
    assert _scram_exchange_began(caplog.text, "SCRAM-SHA-256", "alice")
    assert PASSWORD not in caplog.text

"""``FLYWHEEL_KAFKA_SECURITY_PROTOCOL`` and friends reach every kafka-python client flywheel makes:
the options they map to, a SASL setting without credentials refused with the variables to set, and
a client told to use SASL refused by the plaintext test broker that answers a plaintext one."""

from __future__ import annotations

import pytest

from app.core.net import broker_healthy
from producers.errors import ConfigurationError
from producers.settings import KafkaSettings, kafka_client_options

pytestmark = pytest.mark.integration


def test_the_settings_map_to_kafka_python_options(tmp_path):
    assert KafkaSettings(security_protocol="PLAINTEXT").client_options() == {}
    ca = tmp_path / "ca.pem"
    sasl = KafkaSettings(
        security_protocol="SASL_SSL",
        sasl_mechanism="SCRAM-SHA-512",
        sasl_username="flywheel",
        sasl_password="s3cret",
        ssl_cafile=ca,
    )
    assert sasl.client_options() == {
        "security_protocol": "SASL_SSL",
        "sasl_mechanism": "SCRAM-SHA-512",
        "sasl_plain_username": "flywheel",
        "sasl_plain_password": "s3cret",
        "ssl_cafile": str(ca),
    }
    assert "s3cret" not in repr(sasl)
    with pytest.raises(ConfigurationError, match="FLYWHEEL_KAFKA_SASL_MECHANISM"):
        KafkaSettings(security_protocol="SASL_PLAINTEXT", sasl_username="u").client_options()


def test_a_client_told_to_use_sasl_is_refused_by_the_plaintext_broker(kafka_bootstrap, monkeypatch):
    assert broker_healthy(kafka_bootstrap, timeout_s=5)
    monkeypatch.setenv("FLYWHEEL_KAFKA_SECURITY_PROTOCOL", "SASL_PLAINTEXT")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_MECHANISM", "PLAIN")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_USERNAME", "flywheel")
    monkeypatch.setenv("FLYWHEEL_KAFKA_SASL_PASSWORD", "s3cret")
    assert kafka_client_options()["security_protocol"] == "SASL_PLAINTEXT"
    assert not broker_healthy(kafka_bootstrap, timeout_s=5)  # the SASL handshake is what fails

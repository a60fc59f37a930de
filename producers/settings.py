"""Settings the producer SDK reads: where local state lives and the Kafka-protocol broker, under the
``FLYWHEEL_`` env prefix. Resolution order (highest first): explicit environment variables, then
the local stack's ``$FLYWHEEL_HOME/stack.env`` written by ``flywheel stack up``, then the defaults
below. The service's settings (:mod:`app.core.settings`) build on the same classes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import platformdirs
from pydantic import Field, SecretStr
from pydantic_settings import BaseSettings, SettingsConfigDict

from producers.errors import ConfigurationError


def flywheel_home() -> Path:
    """The directory that holds local state (embedded stack data, checkpoints, reports), not created here.

    ``FLYWHEEL_HOME`` if set (a relative path resolves under the current directory, so
    ``FLYWHEEL_HOME=.flywheel`` keeps a checkout's state beside it), else the user's data directory
    (platformdirs: ``~/.local/share/flywheel`` on Linux, ``$XDG_DATA_HOME/flywheel`` where set), so a
    command finds the same stack whichever directory it runs in.
    """
    env = os.environ.get("FLYWHEEL_HOME")
    return Path(env).resolve() if env else platformdirs.user_data_path("flywheel")


def _env_files() -> tuple[Path, ...]:
    return (flywheel_home() / "stack.env",)


class EnvSettings(BaseSettings):
    """Settings read from the environment, then ``$FLYWHEEL_HOME/stack.env`` (the local stack's)."""

    model_config = SettingsConfigDict(env_file_encoding="utf-8", extra="ignore")

    @classmethod
    def load(cls):
        """Build from the environment and the local stack's env file, if present."""
        return cls(_env_file=_env_files())  # type: ignore[call-arg]


class KafkaSettings(EnvSettings):
    """Kafka-protocol broker and the topics flywheel uses."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_KAFKA_", extra="ignore")
    bootstrap: str | None = Field(default=None, description="host:port[,host:port]")
    interactions_topic: str = Field(
        default="editor.interactions", description="topic the product backend's events go to, keyed by session"
    )
    dlq_topic: str = Field(
        default="editor.interactions.dlq", description="topic of dead letters: events the consumer could not store"
    )
    lifecycle_topic: str = Field(
        default="flywheel.lifecycle",
        description="topic of checkpoint and canary changes (the outbox relay publishes, serving follows)",
    )
    partitions: int = Field(
        default=8,
        ge=1,
        description="partitions of the interactions topic, created with it: at most this many consumer processes "
        "share the load, and two per process even out uneven session keys (bench/ingest.py, 4 "
        "processes on 2 cores: 8 partitions ~5% faster than 4)",
    )
    consumer_group: str = Field(
        default="flywheel-ingest", description="consumer group of the ingest consumers (they split the partitions)"
    )
    max_event_bytes: int = Field(default=1_048_576, ge=1024, description="larger events are dead-lettered (bytes)")
    spool_max_bytes: int = Field(
        default=1 << 30,
        ge=1 << 20,
        description="the producer's disk spool refuses new events past this many undelivered bytes (they are "
        "dropped, counted and reported) so a long broker outage cannot fill the disk",
    )
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = Field(
        default="PLAINTEXT", description="how every flywheel client talks to the brokers: TLS (SSL), SASL, or both"
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism (required with SASL_PLAINTEXT and SASL_SSL)"
    )
    sasl_username: str | None = Field(default=None, description="SASL user name")
    sasl_password: SecretStr | None = Field(default=None, description="SASL password")
    ssl_cafile: Path | None = Field(
        default=None, description="CA bundle (PEM) that verifies the brokers' certificates; default: the system's"
    )
    ssl_certfile: Path | None = Field(default=None, description="client certificate (PEM) for mutual TLS")
    ssl_keyfile: Path | None = Field(default=None, description="the client certificate's private key (PEM)")

    def client_options(self) -> dict[str, object]:
        """kafka-python keyword arguments for the security settings (none for ``PLAINTEXT``), the same
        for every producer, consumer and admin client flywheel makes.

        Raises:
            ConfigurationError: SASL without a mechanism, user name and password.
        """
        if self.security_protocol == "PLAINTEXT":
            return {}
        options: dict[str, object] = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL"):
            if not (self.sasl_mechanism and self.sasl_username and self.sasl_password):
                raise ConfigurationError(
                    f"FLYWHEEL_KAFKA_SECURITY_PROTOCOL={self.security_protocol} needs FLYWHEEL_KAFKA_SASL_MECHANISM, "
                    "FLYWHEEL_KAFKA_SASL_USERNAME and FLYWHEEL_KAFKA_SASL_PASSWORD"
                )
            options.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password.get_secret_value(),
            )
        for name in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, name) is not None:
                options[name] = str(getattr(self, name))
        return options


def kafka_client_options() -> dict[str, object]:
    """:meth:`KafkaSettings.client_options` of the settings in force now."""
    return KafkaSettings.load().client_options()

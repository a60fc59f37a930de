"""Settings the producer SDK reads: where local state lives and the Kafka-protocol broker, under the
``FLYWHEEL_`` env prefix. Resolution order (highest first): explicit environment variables, then
the local stack's ``$FLYWHEEL_HOME/stack.env`` written by ``flywheel stack up``, then the defaults
below. The service's settings (:mod:`app.core.settings`) build on the same classes."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Self

import platformdirs
from pydantic import Field, SecretStr, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict


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
    def load(cls) -> Self:
        """Build from the environment and the local stack's env file, if present."""
        return cls(_env_file=_env_files())


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
        default="PLAINTEXT",
        description="how every flywheel Kafka client (producer SDK, consumers, relay, DLQ, watcher, admin) talks to "
        "the broker: SASL_SSL in production (TLS and credentials), PLAINTEXT for the local stack",
    )
    sasl_mechanism: Literal["PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512"] | None = Field(
        default=None, description="SASL mechanism (SASL_* protocols); SCRAM sends no password over the wire"
    )
    sasl_plain_username: str | None = Field(default=None, description="SASL user name (SASL_* protocols)")
    sasl_plain_password: SecretStr | None = Field(
        default=None, description="SASL password (SASL_* protocols); never logged or shown"
    )
    ssl_cafile: Path | None = Field(
        default=None, description="PEM file of the CA that signed the broker's certificate (SSL, SASL_SSL)"
    )

    @model_validator(mode="after")
    def _sasl_complete(self) -> "KafkaSettings":
        if self.security_protocol.startswith("SASL_"):
            missing = [
                f"FLYWHEEL_KAFKA_{n.upper()}"
                for n in ("sasl_mechanism", "sasl_plain_username", "sasl_plain_password")
                if getattr(self, n) is None
            ]
            if missing:
                raise ValueError(f"security_protocol {self.security_protocol} needs {', '.join(missing)}")
        elif self.sasl_mechanism is not None:
            raise ValueError(f"sasl_mechanism is set but security_protocol {self.security_protocol} is not SASL_*")
        return self

    def security_config(self) -> dict[str, Any]:
        """The kafka-python keyword arguments of these security settings (the password revealed here
        only, for the client; callers never log the result)."""
        cfg: dict[str, Any] = {"security_protocol": self.security_protocol}
        if self.security_protocol.startswith("SASL_"):
            assert self.sasl_plain_password is not None  # _sasl_complete
            cfg.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_plain_username,
                sasl_plain_password=self.sasl_plain_password.get_secret_value(),
            )
        if self.ssl_cafile is not None:
            cfg["ssl_cafile"] = str(self.ssl_cafile)
        return cfg

    def security_summary(self) -> str:
        """The security settings for an error message, without the password."""
        if not self.security_protocol.startswith("SASL_"):
            return f"security_protocol {self.security_protocol}"
        return (
            f"security_protocol {self.security_protocol}, {self.sasl_mechanism} as {self.sasl_plain_username!r}: "
            "check FLYWHEEL_KAFKA_SASL_PLAIN_USERNAME / FLYWHEEL_KAFKA_SASL_PLAIN_PASSWORD"
        )


def kafka_security() -> dict[str, Any]:
    """``KafkaSettings.load().security_config()``: what every flywheel Kafka client adds to its kwargs."""
    return KafkaSettings.load().security_config()

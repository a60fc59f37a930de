"""The base of flywheel's error hierarchy and the errors the producer SDK raises. The service's
errors (:mod:`app.core.errors`) derive from the same base, so one ``except FlywheelError`` catches
both. Domain errors carry an HTTP-ish status so the API maps them in one place."""

from __future__ import annotations


class FlywheelError(Exception):
    """Base of every flywheel error. ``status_code`` is what the API answers with."""

    status_code: int = 500

    def __init__(self, message: str, *, reasons: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.reasons = reasons or []


class ConfigurationError(FlywheelError):
    """Settings or a config file are missing or invalid (e.g. no database URL)."""


class BrokerUnavailableError(FlywheelError):
    """The broker did not take the producer's records while security settings are in force: it is
    down, or it refused the TLS handshake or the SASL credentials (the message names the settings,
    never the password). The events stay spooled."""

    status_code = 503


class InvalidEventError(FlywheelError, ValueError):
    """An event failed to decode or validate. ``reason`` is a short machine-readable code
    (``bad_json``, ``unknown_type``, ``schema_version``, ``validation``, ``oversized``)."""

    status_code = 422

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason

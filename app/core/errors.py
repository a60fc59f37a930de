"""The error hierarchy. Domain errors carry an HTTP-ish status so the API maps them in one place.

Catch an exception only to retry at a boundary or to route a bad message to the dead-letter path;
otherwise let it propagate.
"""

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


class InvalidEventError(FlywheelError, ValueError):
    """An event failed to decode or validate. ``reason`` is a short machine-readable code
    (``bad_json``, ``unknown_type``, ``schema_version``, ``validation``, ``oversized``)."""

    status_code = 422

    def __init__(self, reason: str, message: str) -> None:
        super().__init__(message)
        self.reason = reason


class NotFoundError(FlywheelError):
    """A requested entity (checkpoint, run, token) does not exist."""

    status_code = 404


class ConflictError(FlywheelError):
    """A state transition is refused (gate not passed, stale expected production, ...)."""

    status_code = 409


class AuthError(FlywheelError):
    """Missing or invalid credentials."""

    status_code = 401


class ForbiddenError(FlywheelError):
    """Valid credentials without the required role."""

    status_code = 403


class InfrastructureError(FlywheelError):
    """A service (database, broker, inference server) is unreachable; retry at the boundary."""

    status_code = 503


class CheckpointError(FlywheelError):
    """A checkpoint directory is incomplete, unmarked, corrupt, or a delta does not apply."""

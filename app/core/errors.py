"""The error hierarchy (its base and the event errors come from the producer SDK, :mod:`producers.errors`). Domain errors carry an HTTP-ish status so the API maps them in one place.

Catch an exception only to retry at a boundary or to route a bad message to the dead-letter path;
otherwise let it propagate.
"""

from __future__ import annotations

from producers.errors import ConfigurationError, FlywheelError, InvalidEventError

__all__ = [
    "AuthError",
    "CheckpointError",
    "ConfigurationError",
    "ConflictError",
    "FlywheelError",
    "ForbiddenError",
    "InfrastructureError",
    "InvalidEventError",
    "NotFoundError",
]


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

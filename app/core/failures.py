"""The ``flywheel`` command's exit codes, and which failures are "infrastructure unreachable".

Invariant: every command ends with one of :class:`ExitCode` (docs/operations.md, "Exit codes"), so a
script can tell a negative answer (1) from a mistake in how it called the command (2) from a
service it could not reach (3) without parsing text. Click answers usage errors with 2 itself;
:func:`classify` maps the exceptions a command lets propagate.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

import httpx
from kafka import errors as kafka_errors

from app.core.db import schema_missing_reason, unreachable_reason
from app.core.errors import ConfigurationError, FlywheelError, InfrastructureError


class ExitCode(enum.IntEnum):
    """What a ``flywheel`` command's exit status means."""

    OK = 0
    """It did what was asked, and the answer (if it reports one) is positive."""
    NEGATIVE = 1
    """It ran and the answer is no: a gate that did not pass, a service down, a refused transition,
    an entity that does not exist, contamination found, a replay that differs."""
    USAGE = 2
    """The call was wrong: an unknown option, a bad value, a missing or invalid setting."""
    UNREACHABLE = 3
    """A service it needs did not answer (database, broker, an inference server) or the database
    lacks this release's schema; retrying later, or fixing the deployment, may succeed."""
    INTERNAL = 4
    """A bug: an exception nothing expected (its traceback is on stderr)."""


# A broker that cannot be reached, as kafka-python reports it.
_KAFKA_UNREACHABLE = (
    kafka_errors.BrokerNotAvailableError,
    kafka_errors.KafkaConnectionError,
    kafka_errors.KafkaTimeoutError,
    kafka_errors.NodeNotReadyError,
)


@dataclass(frozen=True)
class Failure:
    """How the command line reports an exception: the exit code, a one-line message, hints."""

    code: ExitCode
    message: str
    hints: list[str] = field(default_factory=list)


def classify(exc: BaseException) -> Failure:
    """The exit code and message for an exception a command let propagate.

    :class:`ConfigurationError` and a request the API would answer 400 or 422 (bad arguments) are
    usage errors (2); :class:`InfrastructureError`, a database that
    does not answer or lacks the schema, a broker or an HTTP server that cannot be reached are 3;
    any other :class:`FlywheelError` (not found, conflict, forbidden, a bad checkpoint) is a
    negative answer (1); anything else is a bug (4).
    """
    if isinstance(exc, ConfigurationError) or (isinstance(exc, FlywheelError) and exc.status_code in (400, 422)):
        return Failure(ExitCode.USAGE, exc.message, list(exc.reasons))
    if isinstance(exc, InfrastructureError):
        return Failure(ExitCode.UNREACHABLE, exc.message, list(exc.reasons))
    if isinstance(exc, FlywheelError):
        return Failure(ExitCode.NEGATIVE, exc.message, list(exc.reasons))
    reason = unreachable_reason(exc)
    if reason is not None:
        return Failure(
            ExitCode.UNREACHABLE,
            f"the database does not answer: {reason}",
            ["check FLYWHEEL_DATABASE_URL, or start the local stack: flywheel stack up"],
        )
    reason = schema_missing_reason(exc)
    if reason is not None:
        return Failure(
            ExitCode.UNREACHABLE,
            f"the database lacks this release's schema: {reason}",
            ["migrate it: flywheel db upgrade"],
        )
    if isinstance(exc, _KAFKA_UNREACHABLE):
        return Failure(
            ExitCode.UNREACHABLE,
            f"the Kafka broker does not answer: {_detail(exc)}",
            ["check FLYWHEEL_KAFKA_BOOTSTRAP, or start the local stack: flywheel stack up"],
        )
    if isinstance(exc, httpx.TransportError | ConnectionError):
        return Failure(ExitCode.UNREACHABLE, f"a server does not answer: {_detail(exc)}")
    return Failure(ExitCode.INTERNAL, f"unexpected {_detail(exc)}")


def _detail(exc: BaseException) -> str:
    """``exc``'s message led by its type's name (once: kafka-python puts it in the message)."""
    text, name = str(exc), type(exc).__name__
    return text if text.startswith(name) else f"{name}: {text}" if text else name

"""Transient-fault classification and retry with backoff (tenacity) for service boundaries
(consumers, the outbox relay, the serving watcher).

Invariant: only infrastructure faults are retried (lost or refused connections, server restarts,
deadlocks and serialization failures, a table or column missing during a deploy that runs the
migration after the new code, broker errors) and a :class:`TransientError` (work that a redo
settles, e.g. a consumer batch the window sweep overtook); anything else propagates so the caller
can isolate and dead-letter the record that caused it.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

import psycopg
from kafka.errors import KafkaError
from sqlalchemy import exc as sa_exc
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    stop_when_event_set,
    wait_exponential_jitter,
)
from tenacity.stop import stop_base

from app.core.db import schema_missing_reason
from app.core.errors import InfrastructureError

log = logging.getLogger(__name__)
T = TypeVar("T")


class TransientError(Exception):
    """Raised by work that a redo in a new transaction settles; :func:`is_transient` retries it."""


def is_transient(exc: BaseException) -> bool:
    """Whether ``exc`` is an infrastructure fault worth retrying rather than a bad input."""
    if schema_missing_reason(exc) is not None:  # a table or column a migration not yet run adds
        return True
    if isinstance(exc, sa_exc.DBAPIError):
        if exc.connection_invalidated:
            return True
        exc = exc.orig or exc
    if isinstance(
        exc, (sa_exc.OperationalError, sa_exc.InterfaceError, sa_exc.DisconnectionError, sa_exc.TimeoutError)
    ):
        return True
    return isinstance(
        exc,
        (
            psycopg.OperationalError,
            psycopg.InterfaceError,
            psycopg.errors.ReadOnlySqlTransaction,
            psycopg.errors.InsufficientPrivilege,
            InfrastructureError,
            TransientError,
            KafkaError,
            ConnectionError,
            TimeoutError,
        ),
    )


def is_unique_violation(exc: BaseException) -> bool:
    """Whether ``exc`` is a unique-key violation: in a batch transaction, the sign that another member
    of the group stored the same rows first (a session split over partitions, a producer's duplicate
    on another partition), which a redo in a new transaction settles."""
    if isinstance(exc, sa_exc.DBAPIError):
        exc = exc.orig or exc
    return isinstance(exc, psycopg.errors.UniqueViolation)


def retry_transient(
    fn: Callable[[], T], what: str, stop: threading.Event, max_wait_s: float, give_up_after_s: float | None = None
) -> T:
    """Run ``fn`` until it succeeds, backing off exponentially (0.1 s doubling, jittered, at most
    ``max_wait_s``) on transient faults; give up only when ``stop`` is set (or, if given, once
    ``give_up_after_s`` seconds have passed since the first try).

    Raises:
        the last exception if it is not transient, or if ``stop`` was set (or the time was up) while
        retrying.
    """

    def _log(rs: RetryCallState) -> None:
        error = rs.outcome.exception() if rs.outcome is not None else None
        log.warning("%s failed (attempt %d), retrying: %s", what, rs.attempt_number, error)

    backoff = wait_exponential_jitter(initial=0.1, max=max_wait_s)

    def wait(rs: RetryCallState) -> float:  # never sleep past the time to give up
        if give_up_after_s is None:
            return backoff(rs)
        return max(0.0, min(backoff(rs), give_up_after_s - (rs.seconds_since_start or 0.0)))

    def sleep(seconds: float) -> None:  # wakes as soon as ``stop`` is set
        stop.wait(seconds)

    until: stop_base = stop_when_event_set(stop)
    if give_up_after_s is not None:
        until = until | stop_after_delay(give_up_after_s)
    return Retrying(
        retry=retry_if_exception(is_transient), reraise=True, wait=wait, stop=until, sleep=sleep, before_sleep=_log
    )(fn)


class Backoff:
    """An exponential backoff schedule for loops that cannot block in :func:`retry_transient` (the
    poll loop: it must keep polling): ``initial`` seconds doubling per failure, at most ``max_s``;
    :meth:`reset` after a success.

    Attributes:
        failures: failures since the last reset.
    """

    def __init__(self, max_s: float, initial: float = 0.1) -> None:
        self.max_s, self.initial, self.failures = max_s, initial, 0

    def next(self) -> float:
        """Count a failure; the seconds to wait before the next try."""
        self.failures += 1
        return min(self.initial * 2.0 ** min(self.failures - 1, 32), self.max_s)

    def reset(self) -> None:
        self.failures = 0

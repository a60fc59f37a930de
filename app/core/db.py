"""SQLAlchemy 2 engine and session factories on psycopg 3.

Boundaries own the transaction (one HTTP request, one Kafka batch, one Celery task): they open a
session with :func:`session_scope`, repositories only ``flush``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

import psycopg
from sqlalchemy import Engine, create_engine
from sqlalchemy import exc as sa_exc
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

from app.core.errors import ConfigurationError
from app.core.settings import get_settings


def normalize_url(url: str) -> str:
    """Force the psycopg 3 driver on a ``postgresql://`` URL (embedded Postgres hands out libpq URIs).

    Raises:
        ConfigurationError: the URL is not a PostgreSQL URL.
    """
    u = make_url(url)
    if not u.drivername.startswith("postgresql"):
        raise ConfigurationError(f"flywheel needs PostgreSQL, got {u.drivername!r}")
    return u.set(drivername="postgresql+psycopg").render_as_string(hide_password=False)


def database_url() -> str:
    """The configured database URL (psycopg 3 driver).

    Raises:
        ConfigurationError: no ``FLYWHEEL_DATABASE_URL`` and no local stack running.
    """
    url = get_settings().database.url
    if url is None:
        raise ConfigurationError("no database configured: set FLYWHEEL_DATABASE_URL or run `flywheel stack up`")
    return normalize_url(url.get_secret_value())


_engines: dict[tuple[str, int, bool, int], Engine] = {}
_engines_lock = threading.Lock()


def get_engine() -> Engine:
    """The process-wide engine for the configured database (one per URL and pool settings)."""
    s = get_settings().database
    key = (database_url(), s.pool_size, s.echo, s.connect_timeout_s)
    with _engines_lock:
        engine = _engines.get(key)
        if engine is None:
            own = "connect_timeout" in make_url(key[0]).query  # the URL's own wins
            connect_args = {} if own else {"connect_timeout": s.connect_timeout_s}
            engine = _engines[key] = create_engine(
                key[0], pool_size=s.pool_size, pool_pre_ping=True, echo=s.echo, connect_args=connect_args
            )
    return engine


def get_sessionmaker() -> sessionmaker[Session]:
    """A session factory bound to :func:`get_engine` (``expire_on_commit=False``)."""
    return sessionmaker(get_engine(), expire_on_commit=False)


@contextmanager
def session_scope() -> Iterator[Session]:
    """One unit of work: commit on success, roll back on any exception (which propagates)."""
    with get_sessionmaker()() as session:
        with session.begin():
            yield session


def reset_engines() -> None:
    """Dispose every engine this process created (tests switch databases; forked workers must
    not share sockets)."""
    with _engines_lock:
        for engine in _engines.values():
            engine.dispose()
        _engines.clear()


def unreachable_reason(exc: BaseException) -> str | None:
    """The first line of a failure to reach Postgres at all (refused, timed out, connection lost: a
    driver error with no SQLSTATE, or the pool's timeout), or None for anything else, a statement's
    error included. Callers answer it as "unavailable, retry", not as a bug."""
    if isinstance(exc, sa_exc.TimeoutError):
        return str(exc).splitlines()[0]
    if isinstance(exc, sa_exc.DBAPIError):
        exc = exc.orig or exc
    if isinstance(exc, (psycopg.OperationalError, psycopg.InterfaceError)) and exc.sqlstate is None:
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None


def schema_missing_reason(exc: BaseException) -> str | None:
    """The first line of a statement's failure on a table or column the database lacks (it was not
    migrated to this release: ``flywheel db upgrade``), or None for anything else."""
    if isinstance(exc, sa_exc.DBAPIError):
        exc = exc.orig or exc
    if isinstance(exc, (psycopg.errors.UndefinedTable, psycopg.errors.UndefinedColumn)):
        return (str(exc).splitlines() or [type(exc).__name__])[0]
    return None

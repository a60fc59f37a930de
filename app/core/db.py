"""SQLAlchemy 2 engine and session factories on psycopg 3.

Boundaries own the transaction (one HTTP request, one Kafka batch, one Celery task): they open a
session with :func:`session_scope`, repositories only ``flush``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from functools import lru_cache

from sqlalchemy import Engine, create_engine
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
        raise ConfigurationError(
            "no database configured: set FLYWHEEL_DATABASE_URL or run `flywheel stack up`"
        )
    return normalize_url(url.get_secret_value())


@lru_cache(maxsize=4)
def _engine_for(url: str, pool_size: int, echo: bool) -> Engine:
    return create_engine(url, pool_size=pool_size, pool_pre_ping=True, echo=echo, future=True)


def get_engine() -> Engine:
    """The process-wide engine for the configured database."""
    s = get_settings().database
    return _engine_for(database_url(), s.pool_size, s.echo)


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
    """Dispose cached engines (tests switch databases; forked workers must not share sockets)."""
    for eng in list(_engine_cache_values()):
        eng.dispose()
    _engine_for.cache_clear()


def _engine_cache_values():
    # lru_cache has no public iteration; rebuild from the current settings' engine if cached.
    try:
        yield get_engine()
    except ConfigurationError:
        return

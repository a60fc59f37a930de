"""Alembic environment: URL from flywheel settings, metadata from ``app.models``."""

from __future__ import annotations

import os

from alembic import context
from sqlalchemy import create_engine, pool
from sqlalchemy.schema import SchemaItem

import app.models  # noqa: F401  (registers every table)
from app.core.db import database_url, normalize_url
from app.core.migrate import is_unmanaged_object, table_of
from app.models.base import Base

config = context.config
target_metadata = Base.metadata

_only = {t for t in os.environ.get("FLYWHEEL_AUTOGEN_TABLES", "").split(",") if t}


def include_object(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: SchemaItem | None
) -> bool:
    """During authoring, ``FLYWHEEL_AUTOGEN_TABLES`` limits autogenerate to one area's tables.
    Tables Celery creates for itself on the same database, and ``event_log``'s partitions, are never Alembic's."""
    if is_unmanaged_object(obj, name, type_, reflected, compare_to):
        return False
    if not _only:
        return True
    return table_of(obj, type_) in _only


def _url() -> str:
    url = config.attributes.get("url") or config.get_main_option("sqlalchemy.url")
    return normalize_url(url) if url else database_url()


def run_migrations_offline() -> None:
    context.configure(url=_url(), target_metadata=target_metadata, literal_binds=True, include_object=include_object)
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    connection = config.attributes.get("connection")
    if connection is not None:
        context.configure(connection=connection, target_metadata=target_metadata, include_object=include_object)
        with context.begin_transaction():
            context.run_migrations()
        return
    engine = create_engine(_url(), poolclass=pool.NullPool)
    with engine.connect() as conn:
        context.configure(connection=conn, target_metadata=target_metadata, include_object=include_object)
        with context.begin_transaction():
            context.run_migrations()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

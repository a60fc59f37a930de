"""Run Alembic migrations from code (``flywheel db upgrade``), wherever flywheel is installed."""

from __future__ import annotations

import functools
import re

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy.engine import Connection
from sqlalchemy.schema import SchemaItem, Table

from app.core.db import database_url, normalize_url

SCRIPT_LOCATION = "migrations:"
"""Alembic's script directory as a package resource (``package:path``): the ``migrations`` package
installed beside ``app``. Alembic reads its files; ``app`` imports none of its code (migrations
build on ``app.models``, so the dependency points from ``migrations`` to ``app`` only)."""

CELERY_TABLE_PREFIXES = ("kombu_", "celery_")
"""Tables kombu's SQL broker and Celery's result backend create for themselves on our database."""


def table_of(obj: SchemaItem, type_: str) -> str | None:
    """The table name of a schema object Alembic compares (a table, or a column/index/constraint of one)."""
    return (
        obj.name if type_ == "table" and isinstance(obj, Table) else getattr(getattr(obj, "table", None), "name", None)
    )


def is_celery_object(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: SchemaItem | None
) -> bool:
    """Whether a schema object Alembic reflected is one of Celery's own tables or their indexes, which
    no migration manages (the arguments of Alembic's ``include_object`` hook)."""
    return reflected and compare_to is None and (table_of(obj, type_) or "").startswith(CELERY_TABLE_PREFIXES)


EVENT_PARTITION_PATTERN = re.compile(r"event_log_(p\d{8}|default)")
"""``event_log``'s partitions (``consumers.partitions``): made by beat and the archive pass, not by migrations."""


def is_unmanaged_object(
    obj: SchemaItem, name: str | None, type_: str, reflected: bool, compare_to: SchemaItem | None
) -> bool:
    """Whether a reflected schema object is none of Alembic's: Celery's tables (:func:`is_celery_object`)
    or an ``event_log`` partition, or an index of one (the arguments of ``include_object``)."""
    if is_celery_object(obj, name, type_, reflected, compare_to):
        return True
    return (
        reflected and compare_to is None and EVENT_PARTITION_PATTERN.fullmatch(table_of(obj, type_) or "") is not None
    )


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged ``migrations/`` and the given (or configured) URL."""
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    cfg.attributes["url"] = normalize_url(url) if url else database_url()
    return cfg


def upgrade(url: str | None = None, revision: str = "head") -> None:
    """Migrate the database to ``revision`` (default head).

    Raises:
        ConfigurationError: no database configured.
        sqlalchemy.exc.OperationalError: the database is unreachable.
    """
    command.upgrade(alembic_config(url), revision)


def downgrade(url: str | None = None, revision: str = "base") -> None:
    """Migrate the database down to ``revision``."""
    command.downgrade(alembic_config(url), revision)


@functools.lru_cache(maxsize=1)
def _script_directory() -> ScriptDirectory:
    cfg = Config()
    cfg.set_main_option("script_location", SCRIPT_LOCATION)
    return ScriptDirectory.from_config(cfg)


def head_revisions() -> frozenset[str]:
    """The revisions this release's ``migrations/`` end at (its heads)."""
    return frozenset(_script_directory().get_heads())


def schema_behind(conn: Connection) -> str | None:
    """Why the database behind ``conn`` (a SQLAlchemy ``Connection``) lacks this release's schema, or
    None: never migrated, or at revisions older than this release's heads. A database a newer
    release has migrated further (a revision this release does not know) is not behind: migrations
    only add what older code can ignore, so a rolling deploy that migrates first keeps old
    processes working.

    Raises:
        sqlalchemy.exc.DBAPIError: the database fails the version query.
    """
    current = frozenset(MigrationContext.configure(conn).get_current_heads())
    heads = head_revisions()
    if not current:
        return "the database has no flywheel schema (it was never migrated)"
    known = {r.revision for r in _script_directory().walk_revisions()}
    if current == heads or not current <= known:
        return None
    return (
        f"the database schema is at revision {', '.join(sorted(current))}; this release needs "
        f"{', '.join(sorted(heads))}"
    )

"""Run Alembic migrations from code (``flywheel db upgrade``), wherever flywheel is installed."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

from app.core.db import database_url, normalize_url


CELERY_TABLE_PREFIXES = ("kombu_", "celery_")
"""Tables kombu's SQL broker and Celery's result backend create for themselves on our database."""


def table_of(obj, type_: str) -> str | None:
    """The table name of a schema object Alembic compares (a table, or a column/index/constraint of one)."""
    return obj.name if type_ == "table" else getattr(getattr(obj, "table", None), "name", None)


def is_celery_object(obj, name: str | None, type_: str, reflected: bool, compare_to) -> bool:
    """Whether a schema object Alembic reflected is one of Celery's own tables or their indexes, which
    no migration manages (the arguments of Alembic's ``include_object`` hook)."""
    return reflected and compare_to is None and (table_of(obj, type_) or "").startswith(CELERY_TABLE_PREFIXES)


def alembic_config(url: str | None = None) -> Config:
    """An Alembic config pointing at the packaged ``migrations/`` and the given (or configured) URL."""
    cfg = Config()
    cfg.set_main_option("script_location", str(Path(migrations.__file__).parent))
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

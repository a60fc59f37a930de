"""Run Alembic migrations from code (``flywheel db upgrade``), wherever flywheel is installed."""

from __future__ import annotations

from pathlib import Path

from alembic import command
from alembic.config import Config

import migrations

from app.core.db import database_url, normalize_url


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

"""Alembic migrations. Run with ``flywheel db upgrade`` (see :mod:`app.core.migrate`)."""

"""The migrations build exactly the schema the ORM models describe (no drift either way)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_migrated_database_matches_the_models(db):
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from app.models import Base

    def ours(obj, name, type_, reflected, compare_to) -> bool:
        """Not the tables Celery's SQL broker and result backend create for themselves (as migrations/env.py)."""
        table = obj.name if type_ == "table" else getattr(getattr(obj, "table", None), "name", "")
        return not (reflected and compare_to is None and (table or "").startswith(("kombu_", "celery_")))

    engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE kombu_probe (id int)"))  # as if Celery had run first
            diff = compare_metadata(MigrationContext.configure(conn, opts={"include_object": ours}), Base.metadata)
            conn.rollback()
    finally:
        engine.dispose()
    assert diff == [], "a model and the migrations disagree (write a migration):\n" + "\n".join(map(str, diff))

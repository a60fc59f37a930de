"""The migrations build exactly the schema the ORM models describe (no drift either way)."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.integration


def test_migrated_database_matches_the_models(db):
    import sqlalchemy as sa
    from alembic.autogenerate import compare_metadata
    from alembic.migration import MigrationContext

    from app.core.migrate import is_unmanaged_object
    from app.models import Base

    engine = sa.create_engine(db.replace("postgresql://", "postgresql+psycopg://", 1))
    try:
        with engine.connect() as conn:
            conn.execute(sa.text("CREATE TABLE kombu_probe (id int)"))  # as if Celery had run first
            ours = {"include_object": lambda *obj: not is_unmanaged_object(*obj)}  # as migrations/env.py
            diff = compare_metadata(MigrationContext.configure(conn, opts=ours), Base.metadata)
            conn.rollback()
    finally:
        engine.dispose()
    assert diff == [], "a model and the migrations disagree (write a migration):\n" + "\n".join(map(str, diff))


def test_dead_letters_stored_before_their_claim_columns_are_attributed_and_redacted(pg_admin_url):
    """A database at 0010 holding dead letters as the older consumer stored them (no user or session
    id, bytes kept whatever they claim) is brought to today's rules by the upgrade to head."""
    import json
    import uuid

    import psycopg

    from app.core.db import reset_engines
    from app.core.migrate import upgrade
    from consumers.deadletter import PRIVATE_DETAIL

    name = f"flywheel_mig_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(pg_admin_url, autocommit=True) as conn:
        conn.execute(f'CREATE DATABASE "{name}"')
    url = pg_admin_url.rsplit("/", 1)[0] + f"/{name}"
    try:
        upgrade(url=url, revision="0010")
        rows = [  # (reason, raw, user_id as stored)
            ("unknown_type", json.dumps({"type": "nope", "user_id": "u-1", "session_id": "s-1"}), None),
            ("validation", json.dumps({"user_id": "u-2", "session_id": "s-private"}), None),
            ("validation", json.dumps({"user_id": "u-3", "session_id": "s-3", "privacy_mode": "yes"}), "u-3"),
            ("missing_fields", json.dumps({"user_id": "u-4", "session_id": "s-4", "privacy_mode": False}), "u-4"),
            ("bad_json", '{"user_id": "u-5", "session_id": "s-5"', None),
            ("validation", json.dumps({"user_id": "x" * 129, "session_id": "s-\x00"}), None),
            ("oversized", json.dumps({"user_id": "u-7", "session_id": "s-7"}), None),
            ("validation", json.dumps([{"user_id": "u-8"}]), None),
        ]
        with psycopg.connect(url) as conn:
            conn.execute("INSERT INTO privacy_tombstone (session_id, events_dropped) VALUES ('s-private', 3)")
            for i, (reason, raw, user) in enumerate(rows):
                conn.execute(
                    'INSERT INTO dead_letter (topic, partition, "offset", key, raw, headers, reason, '
                    "detail, user_id) VALUES ('t', 0, %s, %s, %s, '[[\"h\", \"v\"]]', %s, 'why', %s)",
                    (i, b"k", raw.encode(), reason, user),
                )
        upgrade(url=url)
        with psycopg.connect(url) as conn:
            got = conn.execute(
                "SELECT user_id, session_id, redacted, raw IS NOT NULL, key IS NOT NULL, "
                'headers IS NOT NULL, detail FROM dead_letter ORDER BY "offset"'
            ).fetchall()
    finally:
        reset_engines()
        with psycopg.connect(pg_admin_url, autocommit=True) as conn:
            conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    kept = (None, True, True, True, "why")
    private = ("privacy", False, False, False, PRIVATE_DETAIL + "why")
    assert got == [
        ("u-1", "s-1", *kept),
        ("u-2", "s-private", *private),  # its session has a tombstone
        ("u-3", "s-3", *private),  # its bytes ask for privacy_mode
        ("u-4", "s-4", *kept),
        (None, None, *kept),  # not JSON: found by a byte search, as before
        (None, None, *kept),  # ids the contract refuses are not claims
        (None, None, *kept),  # an oversized record is never parsed
        (None, None, *kept),  # not an object
    ]

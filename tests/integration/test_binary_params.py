"""Pre-encoded ``uuid[]`` parameters bind on any connection the repositories are handed, including one
opened before :mod:`app.repositories.binary` registered its dumper (a pooled connection of a process
that imported the consumer's code late)."""

from __future__ import annotations

import uuid

import psycopg
import pytest
from psycopg import postgres
from psycopg.adapt import AdaptersMap, PyFormat
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from app.core.db import normalize_url
from app.repositories.binary import UUID_ARRAY_OID, UuidArray
from app.repositories.trajectories import load_trajectories

pytestmark = pytest.mark.integration


def _adapters_without_uuid_array() -> AdaptersMap:
    """psycopg's default adapters as a connection opened before the dumper's registration copies them."""
    adapters = AdaptersMap(types=postgres.types)
    postgres.register_default_adapters(adapters)
    return adapters


def test_uuid_arrays_bind_on_a_connection_opened_before_the_dumper_was_registered(db):
    engine = create_engine(normalize_url(db), connect_args={"context": _adapters_without_uuid_array()})
    trajectory_id = uuid.uuid4()
    try:
        with Session(engine) as session:
            driver = session.connection().connection.driver_connection
            # Precondition: bound through this connection's own adapters, the parameter is bytea.
            with pytest.raises(psycopg.errors.WrongObjectType, match="requires array"):
                driver.execute("SELECT 1 WHERE %s::uuid = ANY(%b)", (str(trajectory_id), UuidArray.of([trajectory_id])))
            session.rollback()
            assert load_trajectories(session, [trajectory_id], dict, lock=False) == {}
            driver = session.connection().connection.driver_connection
            assert driver.adapters.get_dumper(UuidArray, PyFormat.BINARY).oid == UUID_ARRAY_OID
            row = driver.execute(
                "SELECT %s::uuid = ANY(%b)", (str(trajectory_id), UuidArray.of([uuid.uuid4(), trajectory_id]))
            ).fetchone()
            assert row == (True,)
    finally:
        engine.dispose()

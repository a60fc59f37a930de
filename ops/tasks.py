"""Operational Celery tasks: a ping to check the worker path end to end, and the trim of delivered
rows that kombu's SQL transport leaves behind (it marks them invisible, never deletes them)."""

from __future__ import annotations

import logging
import os
import socket
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import create_engine, text

from app.worker.celery_app import broker_urls, celery_app

log = logging.getLogger("flywheel.ops.tasks")


@celery_app.task(name="flywheel.ops.ping")
def ping(payload: Any = None) -> dict[str, Any]:
    """Echo ``payload`` with the worker's host and pid (health check and test probe)."""
    log.info("ping answered by pid %d", os.getpid())
    return {"pong": True, "payload": payload, "hostname": socket.gethostname(), "pid": os.getpid()}


@celery_app.task(name="flywheel.ops.purge_broker_messages")
def purge_broker_messages(older_than_s: float = 3600.0) -> int:
    """Delete ``kombu_message`` rows already delivered more than ``older_than_s`` seconds ago.

    Returns the rows deleted (0 when the broker is not the SQL transport).
    """
    url = broker_urls()[0]
    if not url.startswith("sqla+"):
        return 0
    # kombu stamps a row's "timestamp" with the local naive time when it marks it delivered.
    cutoff = datetime.now() - timedelta(seconds=older_than_s)
    engine = create_engine(url.removeprefix("sqla+"), pool_pre_ping=True)
    try:
        with engine.begin() as conn:
            result = conn.execute(
                text('DELETE FROM kombu_message WHERE visible = false AND "timestamp" < :cutoff'), {"cutoff": cutoff}
            )
            return result.rowcount
    finally:
        engine.dispose()

"""Celery task ``flywheel.events.maintain_partitions``: keep ``event_log``'s partitions created
ahead of the clock, and archive those past retention (beat runs it every
``FLYWHEEL_EVENTS_PARTITION_INTERVAL`` s).

Thin: the work is :func:`consumers.partitions.ensure_partitions` and
:func:`consumers.archive.archive_due`. Overlapping runs are harmless: each pass is single-flight
through a Postgres advisory try-lock.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from app.core.db import session_scope
from app.core.settings import get_settings
from app.repositories.events import raw_connection
from app.worker.celery_app import celery_app
from consumers.archive import archive_due
from consumers.partitions import ensure_partitions


@celery_app.task(name="flywheel.events.maintain_partitions", ignore_result=True)
def maintain_partitions() -> dict[str, Any]:
    """Create the partitions missing up to ``FLYWHEEL_EVENTS_PARTITIONS_AHEAD`` periods ahead, then
    archive (Parquet at ``FLYWHEEL_EVENTS_ARCHIVE_URL``, verified, dropped) every partition whose
    range ended ``FLYWHEEL_EVENTS_RETENTION_DAYS`` ago (none when retention is empty).

    Returns ``{"created": [partition names], "archived": [{"partition", "rows", "url"}]}``. No Celery
    retry: the next beat run tries again, and the default partition takes every insert meanwhile.
    """
    s, now = get_settings().events, datetime.now(UTC)
    with session_scope() as session:
        made = ensure_partitions(raw_connection(session), period=s.partition_period, ahead=s.partitions_ahead, now=now)
    done = (
        archive_due(session_scope, root=s.archive_root(), retention_days=s.retention_days, now=now)
        if s.retention_days is not None
        else []
    )
    return {
        "created": [p.name for p in made],
        "archived": [{"partition": a.name, "rows": a.rows, "url": a.url} for a in done],
    }

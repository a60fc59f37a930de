"""Celery task ``flywheel.outbox.relay``: one relay pass (beat runs it every ``FLYWHEEL_OUTBOX_INTERVAL``).

Thin: the work is :class:`app.outbox.relay.OutboxRelay`. One relay (one Kafka producer) is kept per
worker process, created lazily after the fork. Overlapping runs are harmless: the relay is
single-flight through a Postgres advisory lock.
"""

from __future__ import annotations

from app.outbox.relay import OutboxRelay
from app.worker.celery_app import celery_app

_relay: OutboxRelay | None = None


def _get_relay() -> OutboxRelay:
    global _relay
    if _relay is None:
        _relay = OutboxRelay()
    return _relay


@celery_app.task(name="flywheel.outbox.relay", ignore_result=True)
def relay_outbox() -> int:
    """Publish every pending outbox row; returns how many were published.

    No Celery retry: a failed pass leaves the rows pending and beat runs the next pass in seconds.
    """
    return _get_relay().relay_pending()

"""The ingest poll thread's check of each assigned partition's log end against the next offset the
member holds: a log that ends below it was re-created (``consumers.offsets`` says why and what is
done about it).

Invariants:
- It runs after every poll, so it checks each seek to a stored offset (on assignment) by the fetch
  that follows it, and a log re-created under a running member.
- Before it reads the stored offsets again, the batches of the old log already queued land (the
  pipeline's ``drain``), so it judges the offsets they stored.
- Only a stored offset past the log's end is reset: it is reported and counted, then rewound to the
  log's start (a compare-and-set in Postgres) and sought there (``offset_reset = earliest``), or the
  consumer is told to stop with ``consumers.offsets.OffsetBeyondLogEnd`` (``fail``), its stored
  offsets untouched. A partition whose stored offset lies within the log is only re-synchronised
  (:attr:`GroupClient.next` set to the stored offset).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

from app.core.db import session_scope
from consumers import offsets

if TYPE_CHECKING:
    from consumers.kafka_client import GroupClient
    from consumers.telemetry import ConsumerMetrics


def check_log_ends(
    client: GroupClient, drain: Callable[[float], None], retry: Callable, metrics: ConsumerMetrics
) -> offsets.OffsetBeyondLogEnd | None:
    """Compare each assigned partition's log end (the high-water mark of the last fetch) with the
    next offset ``client`` holds for it. For partitions whose log ends below it: ``drain`` the
    pipeline (at most half the poll interval), read the stored offsets again (``retry``: the
    consumer's transient-fault retry), and where a stored offset is past the log's end, report and
    count it, then set it back to the log's start and seek there, or (``offset_reset = fail``)
    return the error the consumer stops with.

    Returns:
        None, or the :class:`consumers.offsets.OffsetBeyondLogEnd` to stop with (nothing was reset).
    Raises:
        Exception: a broker or database fault that is not transient.
    """
    consumer, settings = client.consumer, client.settings
    ends = {tp: consumer.highwater(tp) for tp in consumer.assignment()}
    short = [tp for tp, end in ends.items() if end is not None and end < client.next.get(tp.partition, 0)]
    if not short:
        return None
    drain(settings.max_poll_interval_ms / 2000)  # batches of the old log land first
    stored = retry(client.read_stored_offsets, "reading stored offsets")
    beyond = [tp for tp in short if stored.get(tp.partition, 0) > ends[tp]]
    starts = retry(lambda: consumer.beginning_offsets(beyond), "reading log starts") if beyond else {}
    found = [
        offsets.LogRecreated(client.topic, tp.partition, stored[tp.partition], starts.get(tp) or 0, ends[tp])
        for tp in beyond
    ]
    offsets.report(found, settings.offset_reset)
    for r in found:
        metrics.record_offset_reset(r.partition)
    if found and settings.offset_reset == "fail":
        return offsets.OffsetBeyondLogEnd(
            "a stored offset is past its partition's log end", reasons=[r.describe() for r in found]
        )
    if found:
        stored.update(retry(lambda: _rewind(client.group_id, found), "rewinding stored offsets"))
    for tp in short:
        client.next[tp.partition] = stored.get(tp.partition, ends[tp])
        if tp in beyond:
            consumer.seek(tp, stored[tp.partition])
    return None


def _rewind(group_id: str, found: list[offsets.LogRecreated]) -> dict[int, int]:
    with session_scope() as s:
        return offsets.rewind_to_start(s, group_id, found)

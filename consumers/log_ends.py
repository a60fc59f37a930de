"""The ingest poll thread's check of each assigned partition's log against what the member holds
for it: the identity of its log (``GroupClient.log_ids``) and the next offset (``GroupClient.next``).
A log with another identity, or one that ends below the next offset, was re-created
(``consumers.offsets`` says why and what is done about it).

Invariants:
- It runs after every poll, before the poll's records are handed on, so it checks each seek to a
  stored offset (on assignment) by the fetch that follows it, and a log re-created under a running
  member; the records of a partition it resets or re-synchronises are dropped from that poll (they
  are fetched again from where the partition is sought).
- Before it reads the stored offsets again, the batches of the old log already queued land (the
  pipeline's ``drain``), so it judges the offsets they stored.
- A stored offset counting in another log than the broker's (its stored identity differs), or past
  the log's end, is reported and counted, then pointed at the log's start (with the new identity;
  a compare-and-set in Postgres) and sought there (``offset_reset = earliest``), or the consumer is
  told to stop with ``consumers.offsets.OffsetBeyondLogEnd`` (``fail``), its stored offsets
  untouched. A partition whose stored offset another member already moved is only re-synchronised
  (:attr:`GroupClient.next` and ``log_ids`` set to what is stored, and sought there).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kafka import TopicPartition

from app.core.db import session_scope
from consumers import offsets

if TYPE_CHECKING:
    from consumers.kafka_client import GroupClient
    from consumers.telemetry import ConsumerMetrics


def check_log_ends(
    client: GroupClient, drain: Callable[[float], None], retry: Callable[..., Any], metrics: ConsumerMetrics
) -> tuple[offsets.OffsetBeyondLogEnd | None, set[TopicPartition]]:
    """Compare each assigned partition's log identity (``client.current_log_id()``) and log end (the
    high-water mark of the last fetch) with what ``client`` holds for it. For partitions whose log
    has another identity or ends below the next offset: ``drain`` the pipeline (at most half the
    poll interval), read the stored offsets again (``retry``: the consumer's transient-fault retry),
    and where the stored offset counts in another log or lies past the log's end, report and count
    it, then point it at the log's start and seek there, or (``offset_reset = fail``) return the
    error the consumer stops with. Partitions whose identity was unknown take the current one.

    Returns:
        (None, or the :class:`consumers.offsets.OffsetBeyondLogEnd` to stop with (nothing was
        reset); the partitions sought elsewhere, whose records of this poll must be dropped).
    Raises:
        Exception: a broker or database fault that is not transient.
    """
    consumer, settings = client.consumer, client.settings
    current = client.current_log_id()
    assigned = consumer.assignment()
    if current is not None:
        for tp in assigned:
            if client.log_ids.get(tp.partition) is None:
                client.log_ids[tp.partition] = current
    moved = {tp for tp in assigned if current is not None and client.log_ids.get(tp.partition) != current}
    ends = {tp: consumer.highwater(tp) for tp in assigned}
    short = [
        tp for tp, end in ends.items() if tp not in moved and end is not None and end < client.next.get(tp.partition, 0)
    ]
    if not short and not moved:
        return None, set()
    drain(settings.max_poll_interval_ms / 2000)  # batches of the old log land first
    stored = retry(client.read_stored_offsets, "reading stored offsets")
    replaced = [tp for tp in moved if stored.get(tp.partition, (0, None))[1] not in (None, current)]
    beyond = [tp for tp in short if stored.get(tp.partition, (0, None))[0] > ends[tp]]
    reset = replaced + beyond
    starts = retry(lambda: consumer.beginning_offsets(reset), "reading log starts") if reset else {}
    found: list[offsets.LogRecreated | offsets.LogReplaced] = [
        offsets.LogReplaced(
            client.topic, tp.partition, stored[tp.partition][0], stored[tp.partition][1], current, starts.get(tp) or 0
        )
        for tp in replaced
        if current is not None  # always: a partition moved only to a known log
    ]
    found += [
        offsets.LogRecreated(client.topic, tp.partition, stored[tp.partition][0], starts.get(tp) or 0, ends[tp])
        for tp in beyond
    ]
    offsets.report(found, settings.offset_reset)
    for r in found:
        metrics.record_offset_reset(r.partition)
    if found and settings.offset_reset == "fail":
        return offsets.OffsetBeyondLogEnd(
            "a stored offset counts in another log, or is past its partition's log end",
            reasons=[r.describe() for r in found],
        ), set(assigned)
    next_offsets = {p: o for p, (o, _) in stored.items()}
    if found:
        next_offsets.update(retry(lambda: _reset(client.group_id, found), "resetting stored offsets"))
    for tp in short:
        client.next[tp.partition] = next_offsets.get(tp.partition, ends[tp])
        if tp in beyond:
            consumer.seek(tp, next_offsets[tp.partition])
    for tp in moved:  # reset here, or by another member already: read the new log from what is stored
        client.log_ids[tp.partition] = current
        if tp.partition in next_offsets:
            client.next[tp.partition] = next_offsets[tp.partition]
            consumer.seek(tp, next_offsets[tp.partition])
        else:
            client.next.pop(tp.partition, None)
            consumer.seek_to_beginning(tp)
    return None, set(beyond) | moved


def _reset(group_id: str, found: list[offsets.LogRecreated | offsets.LogReplaced]) -> dict[int, int]:
    with session_scope() as s:
        out = offsets.replace_logs(s, group_id, [r for r in found if isinstance(r, offsets.LogReplaced)])
        out.update(offsets.rewind_to_start(s, group_id, [r for r in found if isinstance(r, offsets.LogRecreated)]))
        return out

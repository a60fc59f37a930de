"""Consumer lag of one ingest group member: per assigned partition, how far its log end is past
the next offset the member holds.

Invariants: lag is never negative; a partition whose log end the client has not learnt yet (no
fetch response so far) is left out rather than reported as 0; offsets come from the member's own
view (``consumers.kafka_client.GroupClient.next``), never from a broker round trip.
"""

from __future__ import annotations

from typing import Any


def partition_lag(consumer: Any, next_offsets: dict[int, int]) -> dict[int, int]:
    """``{partition: records}`` between each assigned partition's high-water mark (the log end the
    last fetch reported) and ``next_offsets`` (the next offset the member holds; 0 where none)."""
    lag = {}
    for tp in consumer.assignment():
        hw = consumer.highwater(tp)
        if hw is not None:
            lag[tp.partition] = max(0, hw - next_offsets.get(tp.partition, 0))
    return lag

"""How the producer SDK builds its kafka-python client (one place for the wire configuration).

Invariant: a record's partition is the one kafka-python's ``DefaultPartitioner`` (the Java client's
murmur2) picks for its key, so every event of a session lands on one partition, in order.
"""

from __future__ import annotations

from typing import Any

from kafka import codec
from kafka.cluster import ClusterMetadata
from kafka.partitioner import DefaultPartitioner, Partitioner

DEFAULT_BATCH_BYTES = 256 * 1024


def default_compression() -> str:
    """``zstd`` when kafka-python can use ``zstandard`` here, else ``gzip`` (always available)."""
    return "zstd" if codec.has_zstd() else "gzip"


class SessionPartitioner(Partitioner):
    """``DefaultPartitioner``'s choice, memoized per (topic, key, partition count).

    A session emits many events under one key, and kafka-python's murmur2 is pure Python (about
    10 µs per record with the partition lookup); the cache makes it a dict lookup. A change in the
    topic's partition count changes the cache key, so a resized topic is re-hashed.
    """

    def __init__(self, max_entries: int = 100_000) -> None:
        self._default = DefaultPartitioner()
        self._cache: dict[tuple[str, bytes, int], int] = {}
        self._max = max_entries

    def partition(
        self,
        topic: str,
        key: object,
        serialized_key: bytes | None,
        value: object,
        serialized_value: bytes | None,
        cluster: ClusterMetadata,
    ) -> int:
        if serialized_key is None:
            return self._default.partition(topic, key, serialized_key, value, serialized_value, cluster)
        parts = cluster.partitions_for_topic(topic)
        ck = (topic, bytes(serialized_key), len(parts) if parts else 0)
        p = self._cache.get(ck)
        if p is None:
            p = self._default.partition(topic, key, serialized_key, value, serialized_value, cluster)
            if len(self._cache) >= self._max:
                self._cache.clear()  # sessions end; a full reset is cheaper than LRU bookkeeping
            self._cache[ck] = p
        return p


def kafka_config(
    bootstrap: str,
    *,
    compression: str,
    linger_ms: int,
    batch_bytes: int,
    max_event_bytes: int,
    delivery_timeout_s: float,
    connect_timeout_s: float,
    security: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Keyword arguments for ``kafka.KafkaProducer``: ``acks=all`` (idempotent), compression,
    batching, and timeouts short enough that an outage is noticed within ``delivery_timeout_s``;
    ``security``: ``KafkaSettings.security_config()`` (TLS, SASL), added as it is."""
    delivery_ms = int(delivery_timeout_s * 1000)
    request_ms = max(1000, min(5000, delivery_ms // 2))
    return dict(
        bootstrap_servers=bootstrap.split(","),
        client_id="flywheel-producer",
        acks="all",
        linger_ms=linger_ms,
        batch_size=batch_bytes,
        compression_type=None if compression == "none" else compression,
        partitioner=SessionPartitioner(),
        max_request_size=max_event_bytes + 65_536,
        request_timeout_ms=request_ms,
        delivery_timeout_ms=max(delivery_ms, request_ms + linger_ms),
        max_block_ms=int(connect_timeout_s * 1000),
        bootstrap_timeout_ms=int(connect_timeout_s * 1000),
        reconnect_backoff_max_ms=1000,
        **(security or {}),
    )

"""What a kafka-python client last heard from the broker about a topic, read where kafka-python
keeps it (its cluster metadata has no public accessor)."""

from __future__ import annotations

from typing import Any


def log_id_of(consumer: Any, topic: str) -> str | None:
    """The identity of ``topic``'s log as ``consumer`` (a ``kafka.KafkaConsumer``) last heard it from
    the broker: ``"<cluster id>/<topic id>"``, or None while its metadata carries no topic id.

    A topic re-created under the same name gets a new topic id (KIP-516); tansu, which keeps its log
    in memory, gives every topic a new one when it restarts. Read from kafka-python's cluster
    metadata (``cluster.topic_id``, Metadata v10+), which the client refreshes after a reconnect and
    every ``metadata_max_age_ms``.
    """
    cluster = consumer._client.cluster  # kafka-python keeps the metadata there; no public accessor
    topic_id = cluster.topic_id(topic)
    if topic_id is None:
        return None
    return f"{cluster.cluster_id or ''}/{topic_id}"

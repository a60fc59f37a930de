"""Kafka -> Postgres: the ingest consumer (event_log + projections + offsets in one transaction),
trajectory projection, reward labeling, dead letters, relabel/replay and erasure."""

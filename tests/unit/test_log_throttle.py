"""``app.core.telemetry.RepeatThrottle``: a library's repeated log line passes once per period."""

from __future__ import annotations

import logging

from app.core.telemetry import RepeatThrottle


def _record(name: str, msg: str, *args, level: int = logging.ERROR) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_a_repeated_library_line_passes_once_per_period_and_says_how_many_were_held():
    now = [0.0]
    throttle = RepeatThrottle("kafka", every_s=30.0, clock=lambda: now[0])
    first = _record("kafka.cluster", "Metadata refresh: failed %s", "KafkaConnectionError")
    assert throttle.filter(first) and first.getMessage() == "Metadata refresh: failed KafkaConnectionError"
    for t in range(1, 30):  # ~1 a second for 29 s: all held back
        now[0] = float(t)
        assert not throttle.filter(_record("kafka.cluster", "Metadata refresh: failed %s", "KafkaConnectionError"))
    # another message, another logger's line, and our own loggers are not held back by it
    assert throttle.filter(_record("kafka.coordinator", "Metadata refresh: failed %s", "x"))
    assert throttle.filter(_record("kafka.cluster", "Coordinator dead"))
    assert throttle.filter(_record("consumers.ingest", "Metadata refresh: failed %s", "x"))
    assert throttle.filter(_record("kafkaesque", "Metadata refresh: failed %s", "x"))
    now[0] = 31.0
    again = _record("kafka.cluster", "Metadata refresh: failed %s", "KafkaConnectionError")
    assert throttle.filter(again)
    assert again.getMessage() == "Metadata refresh: failed KafkaConnectionError [29 more like this in the last 31s]"
    now[0] = 62.0  # nothing held back since: no count
    quiet = _record("kafka.cluster", "Metadata refresh: failed %s", "KafkaConnectionError")
    assert throttle.filter(quiet) and quiet.getMessage().endswith("KafkaConnectionError")

"""The ingest consumer's kafka-python network client: its slow-step warning threshold."""

from __future__ import annotations

import logging
import time

import pytest

from consumers.kafka_client import kafka_net_client


async def _busy_step() -> int:
    time.sleep(0.3)  # one loop step holding the thread, like a poll thread waiting for the GIL
    return 7


@pytest.mark.parametrize("threshold_s,warns", [(0.1, True), (1.0, False), (0.0, False)])
def test_a_loop_step_warns_only_past_the_configured_threshold(caplog, threshold_s, warns):
    client = kafka_net_client(threshold_s)(bootstrap_servers="127.0.0.1:1")  # never connects here
    try:
        with caplog.at_level(logging.WARNING, logger="kafka.net.selector"):
            assert client._net.run(_busy_step) == 7
    finally:
        client.close()
    assert any("ran for" in r.getMessage() for r in caplog.records) == warns

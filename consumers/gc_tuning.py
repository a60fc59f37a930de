"""Interpreter tuning for the ingest consumer's two threads: the GIL switch interval and the cycle
collector.

The poll thread is CPU-bound (decoding) while the DB thread makes ~20 short round trips per batch;
with the default 5 ms GIL switch interval each round trip waits up to 5 ms for the GIL (measured:
0.07 ms -> 3 ms per round trip with a busy thread). 1 ms keeps both moving. Each batch allocates
~50k short-lived objects that reference counting frees; at the default threshold (700) the cycle
collector would run ~70 times a batch, rescanning what is alive (the batches in the pipeline).
Freezing what start-up built and collecting young objects less often takes ~8% of the consumer's
CPU off (``bench/ingest.py``).

Invariant: the settings are process-wide, and :func:`tuned_for_ingest` restores the switch
interval, the collector thresholds and the unfrozen heap on exit, however the block exits.
"""

from __future__ import annotations

import gc
import sys
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def tuned_for_ingest() -> Iterator[None]:
    """Within the block: a GIL switch interval of at most 1 ms, the objects alive at entry frozen
    out of the cycle collector, and a generation-0 threshold of 50,000 allocations."""
    switch = sys.getswitchinterval()
    sys.setswitchinterval(min(switch, 0.001))
    threshold = gc.get_threshold()
    gc.freeze()
    gc.set_threshold(50_000, *threshold[1:])
    try:
        yield
    finally:
        sys.setswitchinterval(switch)
        gc.set_threshold(*threshold)
        gc.unfreeze()

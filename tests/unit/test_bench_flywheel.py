"""bench/flywheel.py's bookkeeping: the demo's steps timed from its output."""

from __future__ import annotations

import importlib.util
import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flywheel.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_flywheel", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


DEMO = """
import time
print("[1/4] stack: Start (or reuse) the embedded stack and migrate.")
time.sleep(0.3)
print('{"session": 0, "reason": "finished"}')
print("[2/4] simulate (cycle 1/2): Simulated editor sessions served by production on")
print("train tasks (only the ones not yet run)")
time.sleep(0.6)
print("[3/4] train (cycle 1/2): done earlier")
print("[4/4] simulate (cycle 2/2): Simulated editor sessions")
time.sleep(0.3)
"""


def test_steps_are_timed_from_line_to_line_and_summed_over_cycles(bench, capsys):
    timings: dict[str, float] = defaultdict(float)
    bench.time_steps([sys.executable, "-c", DEMO], dict(os.environ), timings)
    assert set(timings) == {"stack", "simulate", "train"}
    assert 0.25 <= timings["stack"] < timings["simulate"]  # two cycles of simulate, 0.9 s in all
    assert timings["simulate"] >= 0.85 and timings["train"] < 0.25
    assert '{"session": 0' in capsys.readouterr().out  # the demo's output is passed through


def test_a_failed_demo_stops_the_bench(bench):
    with pytest.raises(SystemExit, match="exited with 3"):
        bench.time_steps([sys.executable, "-c", "print('[1/1] stack: x'); raise SystemExit(3)"], dict(os.environ), {})

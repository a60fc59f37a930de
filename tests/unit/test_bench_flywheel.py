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


def _ab(checkpoint: str, base: float, final: float) -> dict:
    """A ``flywheel ab base CHECKPOINT --json`` result, reduced to what the curve reads."""
    metric = lambda b, f: {  # noqa: E731
        "base": b,
        "final": f,
        "diff": f - b,
        "ci": [f - b - 0.05, f - b + 0.05],
        "base_ci": [b - 0.1, b + 0.1],
        "final_ci": [f - 0.1, f + 0.1],
    }
    return {
        "final": checkpoint,
        "pairs": 108,
        "metrics": {
            "pass_rate": metric(base, final),
            "edit_persistence": metric(0.4, 0.5),
            "dissatisfied_followup_rate": metric(0.6, 0.5),
        },
    }


def test_the_curve_plot_starts_at_base_and_follows_the_served_checkpoints(bench, tmp_path):
    measured = {"ckpt-a": _ab("ckpt-a", 0.2, 0.25), "ckpt-b": _ab("ckpt-b", 0.2, 0.3)}
    curve = [
        {"cycle": 1, "checkpoint": "ckpt-a"},
        {"cycle": 2, "checkpoint": "ckpt-b"},
        {"cycle": 3, "checkpoint": "ckpt-b"},  # cycle 3's candidate was refused: ckpt-b still serves
    ]
    points = bench.plot_points(curve, measured)
    assert [(p["cycle"], p["checkpoint_id"], p["pass_rate"]) for p in points] == [
        (0, "base", 0.2),
        (1, "ckpt-a", 0.25),
        (2, "ckpt-b", 0.3),
        (3, "ckpt-b", 0.3),
    ]
    assert points[0]["signals"]["edit_persistence"] == {"value": 0.4, "ci": [0.30000000000000004, 0.5]}
    path = bench.render_curve_png(points, tmp_path / "curve.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert bench.plot_points([], measured) == []

"""bench/flywheel.py's curve: base first, then the checkpoint production served after each cycle."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flywheel.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_flywheel", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


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

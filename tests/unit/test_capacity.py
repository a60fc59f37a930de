"""The capacity model: every cost names its measurement, the plan scales with traffic, and
``flywheel capacity`` prints it."""

from __future__ import annotations

from typer.testing import CliRunner

from ops.capacity import MEASURED, plan
from ops.cli import app


def _value(rows, quantity: str) -> float:
    (row,) = [r for r in rows if r.quantity == quantity]
    return float(row.value.split()[0].replace(",", ""))


def test_every_cost_names_its_source_and_the_plan_scales_with_sessions():
    assert all(c.source and c.unit and c.value > 0 for c in MEASURED.values())
    small, large = plan(10_000), plan(10_000_000)
    assert _value(large, "events a day") == 1000 * _value(small, "events a day") == 500_000_000
    assert _value(large, "GB a day (Parquet)") > 100 * _value(small, "GB a day (Parquet)")
    assert _value(large, "processes (1 core each)") >= _value(small, "processes (1 core each)")


def test_flywheel_capacity_prints_the_table():
    out = CliRunner().invoke(app, ["capacity", "--sessions-per-day", "1000000", "--sources"])
    assert out.exit_code == 0, out.output
    assert "capacity for 1,000,000 sessions a day" in out.output
    assert "WAL MB/s at peak" in out.output and "docs/gpu.md" in out.output

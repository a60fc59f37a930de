"""The metrics table in docs/operations.md names every OpenTelemetry instrument in the code by its
Prometheus name, and the Grafana dashboard queries only documented series."""

from __future__ import annotations

import ast
import json
import re
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "producers", "consumers", "trainer", "evals", "serving", "ops")
KINDS = {"create_counter": "counter", "create_histogram": "histogram", "create_observable_gauge": "gauge"}


def code_series() -> set[str]:
    """Prometheus names of the instruments created in the code (the exporter's naming rules)."""
    found = set()
    for package in PACKAGES:
        for file in (REPO / package).rglob("*.py"):
            for node in ast.walk(ast.parse(file.read_text())):
                if isinstance(node, ast.Call) and getattr(node.func, "attr", None) in KINDS:
                    name = node.args[0].value.replace(".", "_")
                    unit = next((k.value.value for k in node.keywords if k.arg == "unit"), "")
                    kind = KINDS[node.func.attr]
                    name += "_seconds" if unit == "s" else ""
                    found.add(name + "_total" if kind == "counter" else name)
    return found


def documented_series() -> set[str]:
    text = (REPO / "docs" / "operations.md").read_text()
    section = text[text.index("## Metrics") : text.index("## Traces across the loop")]
    return set(re.findall(r"^\| `(flywheel_[a-z_]+)` \|", section, re.M))


def test_every_instrument_is_documented_by_its_prometheus_name():
    assert code_series() == documented_series()


def test_the_dashboard_queries_documented_series():
    dashboard = json.loads((REPO / "ops" / "deploy" / "grafana-dashboard.json").read_text())
    queried = {
        re.sub(r"_(bucket|sum|count)$", "", name)
        for panel in dashboard["panels"]
        for target in panel["targets"]
        for name in re.findall(r"flywheel_[a-z_]+", target["expr"])
    }
    assert queried and queried <= documented_series(), sorted(queried - documented_series())

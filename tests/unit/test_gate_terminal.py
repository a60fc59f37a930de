"""``flywheel gate``'s explanation fits 80 columns without cutting a name, and says each suite's
decision and power."""

from __future__ import annotations

import io

from rich.console import Console

from evals.gate.decision import decide_gate
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GateConfig, SuiteGate
from evals.gate_terminal import explain
from evals.gating import GateOutcome

CAND, PROD = "ckpt-20261120143055-a1b2c3", "ckpt-20261120120000-d4e5f6"


def _side(name: str, passes: list[bool], k: int) -> SuiteOutcomes:
    return SuiteOutcomes(name, "v1", [Outcome(f"{name}/t{i // k}", i % k, p) for i, p in enumerate(passes)])


def test_the_gate_explanation_fits_80_columns():
    cfg = GateConfig(
        suites={"functions_params": SuiteGate(gated=False), "dataframebench": SuiteGate(), "humaneval": SuiteGate()},
        bootstrap_resamples=500,
        monitors=[],
    )
    cand = {"dataframebench": _side("dataframebench", [False] * 4, 1), "humaneval": _side("humaneval", [True] * 8, 2)}
    prod = {"dataframebench": _side("dataframebench", [False] * 4, 1), "humaneval": _side("humaneval", [False] * 8, 2)}
    cand["functions_params"] = _side("functions_params", [True, False] * 6, 4)
    prod["functions_params"] = _side("functions_params", [False, True] * 6, 4)
    result = decide_gate(cand, prod, cfg)
    con = Console(width=80, record=True, file=io.StringIO(), color_system=None)
    explain(con, GateOutcome("d-1", CAND, PROD, result, "/reports/gates/d-1"))
    text = con.export_text()
    assert max(len(line) for line in text.splitlines()) <= 80
    assert "…" not in text
    for name in (CAND, PROD, "dataframebench", "functions_params", "humaneval", "insufficient_evidence"):
        assert name in text, name
    row = next(
        line.split() for line in text.splitlines() if line.split()[:2] == ["dataframebench", "insufficient_evidence"]
    )
    assert row[2:] == ["0.00", "2.0", "+0.0", "[-40.3,", "+40.3]"]
    assert "reported, not gating" in text
    assert "INSUFFICIENT EVIDENCE" in text and "override_reason" in text

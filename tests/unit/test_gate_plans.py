"""The shipped held-out gate meets its sizing rule, and a smaller plan (the demo's and the bench's
``--gate-samples``) says it is underpowered wherever it is shown (issue 70, item 7)."""

from __future__ import annotations

from evals.gate.plans import plan_power, policy_toml, smaller_plan
from evals.gate.policy import load_gate_config
from ops.demo import DemoOptions, loop_env
from ops.demo_gate import gate_plan


def test_the_shipped_plan_is_powered_and_a_smaller_one_says_underpowered(tmp_path):
    shipped = load_gate_config()
    plan = plan_power(shipped, "functions", 112, shipped)
    assert (plan.samples, plan.pairs) == (8, 896) and plan.power >= 0.8 and not plan.underpowered
    assert "UNDERPOWERED" not in plan.line()
    path = tmp_path / "gate.toml"
    path.write_text(policy_toml(smaller_plan(shipped, "functions", 1, 112), "smaller"))
    smaller = load_gate_config(path)  # the written policy loads back
    small = plan_power(smaller, "functions", 112, shipped)
    assert small.underpowered and small.power < 0.3 and small.pairs == 112
    assert "UNDERPOWERED" in small.line() and "k = 8" in small.line() and small.as_dict()["underpowered"] is True
    # the smaller plan differs in that suite's samples and min_pairs only
    a, b = shipped.model_dump(), smaller.model_dump()
    assert {k for k in a if a[k] != b[k]} == {"suites"}
    fa, fb = a["suites"]["functions"], b["suites"]["functions"]
    assert {k for k in fa if fa[k] != fb[k]} == {"samples", "min_pairs"} and fb["min_pairs"] == 112
    assert {n: s for n, s in a["suites"].items() if n != "functions"} == {
        n: s for n, s in b["suites"].items() if n != "functions"
    }


def test_the_demo_runs_the_shipped_plan_unless_told_and_then_its_loop_reads_the_smaller_one(tmp_path):
    path, plan = gate_plan(tmp_path, None, None, None)
    assert path is None and not plan.underpowered
    opts = DemoOptions(gate_samples=2, eval_tasks=40)
    path, plan = gate_plan(tmp_path, None, 2, 40)
    assert path == tmp_path / "demo" / "gate.toml" and plan.underpowered and plan.pairs == 80
    assert loop_env(opts, tmp_path, 8000)["FLYWHEEL_EVAL_GATE_CONFIG"] == str(path)

"""Suite and gate configs: the shipped TOMLs load, typos are refused, fingerprints track every knob."""

from __future__ import annotations

import pytest

from app.core.errors import ConfigurationError
from evals.config import SuiteConfig, list_suites, load_suite
from evals.gate.policy import load_gate_config


def test_shipped_suites_load():
    assert {"dataframebench", "humaneval", "functions", "functions_params", "mined"} <= set(list_suites())
    dfb = load_suite("dataframebench")
    assert (dfb.source, dfb.split) == ("dataframebench", "test")
    assert load_suite("humaneval").source == "humaneval"
    assert load_suite("mined").source == "mined"
    fn, params = load_suite("functions"), load_suite("functions_params")
    assert (fn.source, fn.split, params.source, params.split) == ("functions", "test", "functions", "test_params")
    assert fn.budget.max_turns <= 3 and fn.budget.max_tokens_per_turn <= 256  # small budgets: in-reach tasks


def test_shipped_gate_gates_every_shipped_suite():
    gate = load_gate_config()
    assert set(gate.gated_suites()) == {"dataframebench", "functions", "humaneval", "mined"}
    assert gate.confidence == 0.95 and gate.margin == 0.02
    assert {m.metric for m in gate.monitors} >= {
        "invalid_tool_call_rate",
        "clarifying_question_rate",
        "edit_rate",
        "mean_completion_tokens",
        "mean_latency_s",
    }
    assert gate.for_suite("dataframebench").min_pairs == 20
    assert gate.for_suite("unknown").margin == 0.02


def test_training_split_and_unknown_keys_are_refused(tmp_path):
    with pytest.raises(ValueError, match="train split"):
        SuiteConfig(name="x", version="1", source="dataframebench", split="train")
    with pytest.raises(ValueError, match="train split"):
        SuiteConfig(name="x", version="1", source="functions", split="train")
    bad = tmp_path / "typo.toml"
    bad.write_text('version = "1"\nsource = "humaneval"\nsample_per_task = 3\n')
    with pytest.raises(ConfigurationError, match="sample_per_task"):
        load_suite(bad)
    with pytest.raises(ConfigurationError, match="unknown suite"):
        load_suite("no-such-suite")


def test_gate_config_refuses_unbounded_monitor(tmp_path):
    p = tmp_path / "gate.toml"
    p.write_text('[suites.a]\n[[monitors]]\nmetric = "edit_rate"\n')
    with pytest.raises(ConfigurationError, match="abs_tolerance"):
        load_gate_config(p)


def test_a_policy_that_still_says_tolerance_is_told_to_rename_it(tmp_path):
    """``tolerance`` was the margin's name: gate-wide or in a suite, it fails naming ``margin``."""
    p = tmp_path / "gate.toml"
    for text in ("tolerance = 0.02\n", "[suites.functions]\ntolerance = 0.045\n"):
        p.write_text(text)
        with pytest.raises(ConfigurationError, match="`tolerance` is now `margin`"):
            load_gate_config(p)
    p.write_text("margin = 0.03\n[suites.functions]\nmargin = 0.045\n")
    gate = load_gate_config(p)
    assert (gate.margin, gate.for_suite("functions").margin, gate.for_suite("other").margin) == (0.03, 0.045, 0.03)


def test_fingerprint_tracks_config_and_task_set():
    s = load_suite("humaneval")
    keys = ["HumanEval/0:abc", "HumanEval/1:def"]
    fp = s.fingerprint(keys)
    assert fp.startswith(f"{s.version}-") and fp == s.fingerprint(list(keys))
    assert s.fingerprint(keys[:1]) != fp
    assert s.with_limit(5).fingerprint(keys) != fp
    assert s.model_copy(update={"samples_per_task": 2}).fingerprint(keys) != fp
    assert s.with_limit(None) is s


def test_min_pairs_override_applies_to_every_suite():
    gate = load_gate_config().with_min_pairs(2)
    assert {gate.for_suite(n).min_pairs for n in ("dataframebench", "humaneval", "mined", "other")} == {2}
    assert load_gate_config().with_min_pairs(None) == load_gate_config()

"""The paired A/B on fresh traffic (ops/ab.py) and its clustered intervals (app/core/intervals.py).

The A/B runs real agent sessions through the product harness with scripted policies (a policy that
writes the task's reference, or a wrong body, into ``solution.py``), real hidden-test grading in the
sandbox and the real simulated developers.
"""

from __future__ import annotations

import hashlib
import math
import threading
from collections import Counter

import numpy as np
import pytest

from app.core.errors import ConfigurationError
from app.core.intervals import clustered_ratio_interval, paired_ratio_diff_interval
from app.inference.engine import Generation, InferenceEngine
from app.lifecycle.online_stats import SessionSignals, ratio_estimate
from evals.tasks import load_tasks
from evals.tasks.functions import template_of
from ops import ab
from ops.ab import ABConfig, ArmRun, ArmSession, compare_arms, plan_pairs, run_ab
from ops.simulator import PRODUCTION_MIX

# ---- intervals ----------------------------------------------------------------------------------


def _two_arms(rng, tasks: int, samples: int, shift: float):
    """Per-pair outcomes of two arms: each task has its own base rate (heterogeneous clusters)."""
    ids, a, b = [], [], []
    for t in range(tasks):
        p = rng.uniform(0.1, 0.8)
        for _ in range(samples):
            ids.append(f"t{t}")
            b.append(float(rng.random() < p))
            a.append(float(rng.random() < min(1.0, p + shift)))
    return ids, a, b


def test_a_known_difference_is_detected_and_covered():
    rng = np.random.default_rng(1)
    ids, a, b = _two_arms(rng, tasks=40, samples=10, shift=0.15)
    ones = [1.0] * len(ids)
    d = paired_ratio_diff_interval(ids, a, ones, b, ones)
    assert d is not None and d.clusters == 40
    assert d.low > 0 and d.low < 0.15 < d.high
    assert d.value == pytest.approx(np.mean(a) - np.mean(b))
    one_sided = paired_ratio_diff_interval(ids, a, ones, b, ones, two_sided=False)
    assert d.low < one_sided.low < d.value  # one tail of 5 % is tighter than 2.5 %


def test_identical_arms_give_an_interval_containing_zero_at_the_stated_rate():
    rng = np.random.default_rng(2)
    covered = 0
    runs = 400
    for _ in range(runs):
        ids, a, b = _two_arms(rng, tasks=30, samples=4, shift=0.0)
        ones = [1.0] * len(ids)
        d = paired_ratio_diff_interval(ids, a, ones, b, ones)
        covered += d.low <= 0.0 <= d.high
    assert 0.92 <= covered / runs <= 0.985  # nominal 95 %
    same = paired_ratio_diff_interval(ids, a, ones, a, ones)
    assert (same.value, same.low, same.high) == (0.0, 0.0, 0.0)


def test_ratio_variance_is_the_delta_method_with_the_cr1_factor():
    # Deng et al. 2018: Var(R) = G/(G-1) * sum_i (X_i - R Y_i)^2 / (sum Y)^2, the canary's formula
    ids = ["a", "a", "b", "c", "c", "c", "d"]
    x = [0.9, 0.1, 0.5, 1.0, 0.0, 0.7, 0.2]
    y = [1.0, 1.0, 1.0, 2.0, 1.0, 1.0, 1.0]
    est = clustered_ratio_interval(ids, x, y)
    canary = ratio_estimate(
        [SessionSignals(user_id=i, persisted_sum=s, persisted_n=int(n)) for i, s, n in zip(ids, x, y)],
        "edit_persistence",
    )
    assert est.value == pytest.approx(canary.value) and est.se == pytest.approx(canary.se)
    assert est.high - est.value == pytest.approx(est.se * 3.182, rel=1e-3)  # t(0.975, 3 df)


def test_pairing_removes_the_shared_task_effect():
    rng = np.random.default_rng(3)
    ids, a, b = _two_arms(rng, tasks=40, samples=6, shift=0.05)
    ones = [1.0] * len(ids)
    paired = paired_ratio_diff_interval(ids, a, ones, b, ones)
    sa, sb = clustered_ratio_interval(ids, a, ones), clustered_ratio_interval(ids, b, ones)
    assert paired.se < math.hypot(sa.se, sb.se)


def test_undefined_estimates_are_none():
    assert clustered_ratio_interval(["a", "a"], [1.0, 0.0], [1.0, 1.0]) is None  # one cluster
    assert paired_ratio_diff_interval(["a", "b"], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 1.0]) is None
    with pytest.raises(ValueError):
        clustered_ratio_interval(["a", "b"], [1.0], [1.0, 1.0])


# ---- the plan ------------------------------------------------------------------------------------


def test_the_old_draw_takes_unseen_parameters_of_training_templates_with_the_mix():
    train = load_tasks("functions", "train")
    train_ids, train_requests = {t.id for t in train}, {t.request for t in train}
    train_templates = {t.metadata["template"] for t in train}
    pairs = plan_pairs(ABConfig(split="test_params", samples=3, difficulty_mix={1: 1.0}))
    tasks = {t.id: t for t, _ in pairs}
    assert len(pairs) == 3 * len(tasks) and len(tasks) >= 25
    for t in tasks.values():
        assert t.split == "test_params" and t.metadata["difficulty"] == 1
        assert t.id not in train_ids and t.request not in train_requests
        assert t.metadata["template"] in train_templates  # the production request distribution
    small = plan_pairs(ABConfig(split="test_params", tasks=5, samples=3, difficulty_mix={1: 1.0}))
    assert small == pairs[:15]  # a smaller draw is a prefix: its sessions are reused
    with pytest.raises(ConfigurationError):
        plan_pairs(ABConfig(difficulty_mix={7: 1.0}))


def test_the_default_draw_is_fresh_traffic_at_the_production_mix():
    """By default the A/B draws the ``fresh`` split (kinds of request neither trained on nor held
    out for the gate, at production difficulty) with the production mix; its pairs cluster by template."""
    train, held_out = load_tasks("functions", "train"), load_tasks("functions", "test")
    seen_templates = {t.metadata["template"] for t in train + held_out}
    config = ABConfig(samples=2)
    assert config.split == "fresh" and config.difficulty_mix == PRODUCTION_MIX and config.cluster_by == "template"
    pairs = plan_pairs(config)
    tasks = {t.id: t for t, _ in pairs}
    fresh = load_tasks("functions", "fresh")
    assert len(tasks) == len(fresh) == 67 and len(pairs) == 2 * 67  # the whole split at the mix's levels
    assert all(t.split == "fresh" and t.metadata["template"] not in seen_templates for t in tasks.values())
    # The draw's order follows the mix: the first 20 picks lean to level 1 as production does.
    first = [t for t, s in plan_pairs(ABConfig(tasks=20, samples=1))]
    levels = Counter(t.metadata["difficulty"] for t in first)
    assert levels[1] >= 9 and levels[2] >= 2 and sum(levels.values()) == 20
    assert [t.id for t, _ in pairs[:40:2]] == [t.id for t in first]  # a prefix of the same draw
    # The old draw keeps its stored sessions: its fingerprint is what it was before the split existed.
    old = ABConfig(split="test_params", difficulty_mix=None)
    assert old.fingerprint() != ABConfig().fingerprint()
    assert old.fingerprint() == ABConfig(split="test_params", cluster_by="task").fingerprint()


def _sessions(checkpoint_id: str, pairs, passes) -> ArmRun:
    run = ArmRun(checkpoint_id, ran=len(pairs))
    for task, sample in pairs:
        ok = passes(task.id)
        run.sessions[(task.id, sample)] = ArmSession(
            task_id=task.id,
            sample=sample,
            task_hash="h",
            checkpoint_id=checkpoint_id,
            passed=ok,
            outcome="passed" if ok else "failed",
            accepted=1,
            rejected=int(not ok),
            persisted_sum=float(ok),
            persisted_n=1,
            followups=int(not ok),
            completion_tokens=100,
            latency_s=1.0,
            turns=2,
            reason="done",
        )
    return run


def test_fresh_traffic_intervals_cluster_by_template():
    """A gain concentrated in two templates (every task of theirs newly passes): clustered by
    template the interval of the difference is wider than clustered by task, and the report counts
    templates as clusters beside the tasks."""
    pairs = plan_pairs(ABConfig(samples=2))
    tasks = sorted({t.id for t, _ in pairs})
    winners = sorted({template_of(t) for t in tasks})[:2]
    base = _sessions("base", pairs, lambda task_id: task_id.endswith("/0"))
    final = _sessions("final", pairs, lambda task_id: task_id.endswith("/0") or template_of(task_id) in winners)
    by_template = compare_arms(base, final, pairs)
    by_task = compare_arms(base, final, pairs, cluster_by="task")
    assert by_template["split"] == "fresh" and by_template["cluster_by"] == "template"
    assert (by_template["tasks"], by_template["clusters"], by_task["clusters"]) == (67, 12, 67)
    t, k = by_template["metrics"]["pass_rate"], by_task["metrics"]["pass_rate"]
    assert t["diff"] == k["diff"] > 0
    assert t["ci"][1] - t["ci"][0] > k["ci"][1] - k["ci"][0]
    assert by_template["pass_rate_lower_bound"] < by_task["pass_rate_lower_bound"]


# ---- the A/B through the harness -----------------------------------------------------------------


class FunctionPolicy(InferenceEngine):
    """Answers each request with one code block: the task's reference where ``solves(task_id,
    seed)``, else a wrong body. Records the (task, sampling seed) of every first turn."""

    def __init__(self, tokenizer, tasks, checkpoint_id: str, solves) -> None:
        self.tokenizer, self.checkpoint_id, self.solves = tokenizer, checkpoint_id, solves
        self.tasks = tasks
        self.seen: list[tuple[str, int]] = []
        self.closed = False
        self._lock = threading.Lock()
        self._end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params):
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            task = next(t for t in self.tasks if t.request in text)
            with self._lock:
                self.seen.append((task.id, params.seed))
            if self.solves(task.id, params.seed):
                code = task.reference_files["solution.py"]
            else:
                code = task.files["solution.py"].replace("raise NotImplementedError", "return None")
            ids = list(self.tokenizer(f"```python\n{code}```", add_special_tokens=False).input_ids) + [self._end]
            out.append(
                Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", latency_s=0.01 * len(ids))
            )
        return out

    def load_checkpoint(self, checkpoint_id, path):
        raise NotImplementedError

    def apply_delta(self, checkpoint_id, delta_path, parent_id):
        raise NotImplementedError

    def close(self):
        self.closed = True


def _half(task_id: str, seed: int) -> bool:
    """Solves about half the tasks, the same ones at every seed (2 of the 6 the test config draws)."""
    return hashlib.sha256(f"{task_id}:c".encode()).digest()[0] % 2 == 0


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


CONFIG = ABConfig(
    tasks=6, samples=3, difficulty_mix={1: 1.0}, max_turns=2, max_tokens=512, max_tokens_per_turn=256, workers=4
)


@pytest.fixture
def no_event_stream(monkeypatch):
    """Any producer or Kafka client an A/B built would fail the test; every harness call is checked
    to run with ``emit=None``."""
    import kafka

    import producers.producer as producer_module

    def refuse(*args, **kwargs):
        raise AssertionError("an A/B session reached the event stream")

    monkeypatch.setattr(producer_module.EventProducer, "__init__", refuse)
    monkeypatch.setattr(producer_module.EventProducer, "emit", refuse)
    monkeypatch.setattr(kafka.KafkaProducer, "__init__", refuse)
    real = ab.run_agent_session
    calls = []

    def checked(*args, **kwargs):
        assert kwargs["emit"] is None
        calls.append(kwargs["session_id"])
        return real(*args, **kwargs)

    monkeypatch.setattr(ab, "run_agent_session", checked)
    return calls


def _engines(tokenizer, **solves):
    tasks = [t for t, _ in plan_pairs(CONFIG)]
    made: dict[str, FunctionPolicy] = {}

    def engine_for(checkpoint_id: str) -> FunctionPolicy:
        made[checkpoint_id] = FunctionPolicy(tokenizer, tasks, checkpoint_id, solves[checkpoint_id])
        return made[checkpoint_id]

    return engine_for, made


def test_arms_are_paired_and_a_known_difference_shows(tokenizer, tmp_path, no_event_stream):
    engine_for, made = _engines(tokenizer, base=_half, final=lambda task_id, seed: True)
    report = run_ab("base", "final", CONFIG, engine_for=engine_for, store=tmp_path)

    assert report["pairs"] == 18 and report["tasks"] == 6 and not report["errors"]
    assert len(no_event_stream) == 36  # every session ran through the harness without a stream
    # same tasks and the same sampling seed per (task, sample) in both arms
    assert sorted(made["base"].seen) == sorted(made["final"].seen)
    assert len(set(made["base"].seen)) == 18
    assert made["base"].closed and made["final"].closed
    m = report["metrics"]
    solved = sum(_half(task_id, 0) for task_id in {t.id for t, _ in plan_pairs(CONFIG)})
    assert m["pass_rate"]["final"] == 1.0 and m["pass_rate"]["base"] == pytest.approx(solved / 6)
    assert m["pass_rate"]["diff"] == pytest.approx(1 - solved / 6)
    # 6 tasks from a few templates: the one-sided bound shows the gain; the two-sided interval,
    # clustered by template, is wide at so few clusters.
    assert report["pass_rate_lower_bound"] > 0 and m["pass_rate"]["ci"][0] < m["pass_rate"]["diff"]
    assert report["cluster_by"] == "template" and 2 <= report["clusters"] <= 6
    assert m["dissatisfied_followup_rate"]["diff"] < 0 and m["edit_persistence"]["diff"] > 0


def test_identical_policies_face_the_same_developer_draws(tokenizer, tmp_path, no_event_stream):
    engine_for, _ = _engines(tokenizer, a=_half, b=_half)
    report = run_ab("a", "b", CONFIG, engine_for=engine_for, store=tmp_path)
    for name, m in report["metrics"].items():
        assert m["diff"] == pytest.approx(0.0), name  # same outputs, same developer reactions
        assert m["ci"] is None or m["ci"][0] <= 0.0 <= m["ci"][1]
    # the developer did react (accepts, persistence, follow-ups drawn), just alike in both arms
    assert report["metrics"]["edit_acceptance"]["base"] > 0
    assert report["metrics"]["dissatisfied_followup_rate"]["base"] > 0


def test_stored_sessions_are_reused_and_the_arm_must_be_served_by_its_checkpoint(tokenizer, tmp_path):
    engine_for, _ = _engines(tokenizer, base=_half, final=_half)
    first = run_ab("base", "final", CONFIG, engine_for=engine_for, store=tmp_path)

    def no_engine(checkpoint_id):
        raise AssertionError("every session is stored: no engine is needed")

    again = run_ab("base", "final", CONFIG, engine_for=no_engine, store=tmp_path)
    assert again["sessions"] == {"base": {"ran": 0, "reused": 18}, "final": {"ran": 0, "reused": 18}}
    assert again["metrics"] == first["metrics"]
    smaller = run_ab("base", "final", CONFIG.model_copy(update={"tasks": 3}), engine_for=no_engine, store=tmp_path)
    assert smaller["pairs"] == 9

    def wrong(checkpoint_id):
        return FunctionPolicy(tokenizer, [], "production", _half)

    with pytest.raises(ConfigurationError, match="serving production"):
        run_ab("x", "y", CONFIG, engine_for=wrong, store=tmp_path)


def test_two_runs_arms_compare_on_the_same_draw_without_serving_again(tokenizer, tmp_path):
    """Real minus placebo: each run measured its own checkpoint against base in its own home; one
    run's stored arm copied into the other's store pairs the two checkpoints on the same requests
    and developers, and nothing is served again."""
    import shutil

    real_home, placebo_home = tmp_path / "real", tmp_path / "placebo"
    engine_for, _ = _engines(tokenizer, base=_half, real=lambda task_id, seed: True, placebo=_half)
    run_ab("base", "real", CONFIG, engine_for=engine_for, store=real_home)
    run_ab("base", "placebo", CONFIG, engine_for=engine_for, store=placebo_home)
    shutil.copytree(real_home / "real", placebo_home / "real")

    def no_engine(checkpoint_id):
        raise AssertionError("both arms are stored: no engine is needed")

    report = run_ab("placebo", "real", CONFIG, engine_for=no_engine, store=placebo_home)
    solved = sum(_half(t.id, 0) for t, _ in plan_pairs(CONFIG)) / len(plan_pairs(CONFIG))
    assert report["pairs"] == 18 and report["sessions"]["final"] == {"ran": 0, "reused": 18}
    assert report["metrics"]["pass_rate"]["diff"] == pytest.approx(1 - solved)


def test_the_cli_refuses_an_unknown_split_or_cluster_before_serving():
    from typer.testing import CliRunner

    from ops.cli import app

    for args in (["--split", "train"], ["--cluster-by", "user"]):
        result = CliRunner().invoke(app, ["ab", "base", "final", *args, "--no-record"])
        assert result.exit_code == 2, result.output
        assert args[0] in result.output

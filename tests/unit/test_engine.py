"""Torch engine: behaviour log-probs equal a teacher-forced forward pass; batching, seeds, stops."""

from __future__ import annotations

import math

import pytest
import torch

from app.inference.engine import SamplingParams
from serving.engine import setup_engine
from serving.torch_engine import TorchEngine, sample_next, teacher_forced_logprobs

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> TorchEngine:
    torch.set_num_threads(2)
    return TorchEngine(tiny_model_dir, checkpoint_id="tiny")


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 1.0)])
def test_logprobs_match_teacher_forced_pass_with_padding(engine, temperature, top_p):
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=10, temperature=temperature, top_p=top_p, seed=7))
    assert len(gens) == len(PROMPTS)
    for prompt, gen in zip(PROMPTS, gens):
        assert len(gen.token_ids) == len(gen.logprobs) == 10
        assert gen.finish_reason == "length"
        ref = teacher_forced_logprobs(engine.model, prompt, gen.token_ids, temperature)
        assert torch.allclose(torch.tensor(gen.logprobs), ref, atol=1e-4), (gen.logprobs, ref.tolist())


def test_completion_does_not_depend_on_batch(engine):
    params = SamplingParams(max_tokens=8, temperature=0.0)
    alone = engine.generate([PROMPTS[1]], params)[0]
    batched = engine.generate(PROMPTS, params)[1]
    assert alone.token_ids == batched.token_ids
    assert max(abs(a - b) for a, b in zip(alone.logprobs, batched.logprobs)) < 1e-4


def test_seed_reproduces_and_differs(engine):
    p = SamplingParams(max_tokens=8, temperature=1.0, seed=123)
    a, b = engine.generate(PROMPTS, p), engine.generate(PROMPTS, p)
    c = engine.generate(PROMPTS, SamplingParams(max_tokens=8, temperature=1.0, seed=124))
    assert [g.token_ids for g in a] == [g.token_ids for g in b]
    assert [g.token_ids for g in a] != [g.token_ids for g in c]


def test_stop_token_is_returned_with_its_logprob(engine):
    greedy = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0))[0]
    stop_at = greedy.token_ids[2]
    gen = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=6, temperature=0.0, stop_token_ids=(stop_at,)))[0]
    first = greedy.token_ids.index(stop_at)
    assert gen.token_ids == greedy.token_ids[: first + 1]
    assert gen.finish_reason == "stop" and len(gen.logprobs) == len(gen.token_ids)


def test_top_p_samples_only_the_nucleus_and_renormalises():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05]])
    logits = probs.log().repeat(400, 1)
    params = SamplingParams(temperature=1.0, top_p=0.7, seed=0)
    tokens, logp = sample_next(logits, params, torch.Generator().manual_seed(0))
    assert set(tokens.tolist()) == {0, 1}
    expected = {0: math.log(0.5 / 0.8), 1: math.log(0.3 / 0.8)}
    for t, lp in zip(tokens.tolist(), logp.tolist()):
        assert abs(lp - expected[t]) < 1e-5


def test_sampling_params_validate():
    with pytest.raises(ValueError):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError):
        SamplingParams(max_tokens=0)


def test_setup_engine_fails_loudly_on_unknown_type(tiny_model_dir):
    from app.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="unknown inference engine"):
        setup_engine(engine="tgi", model_dir=tiny_model_dir)
    with pytest.raises(ConfigurationError, match="FLYWHEEL_SERVING_URL"):
        setup_engine(engine="vllm", model_dir=tiny_model_dir)
    eng = setup_engine(engine="torch", model_dir=tiny_model_dir, checkpoint_id="x")
    assert eng.checkpoint_id == "x" and eng.tokenizer.eos_token_id == 2


def test_moe_reports_routed_experts(tiny_moe_model_dir):
    eng = TorchEngine(tiny_moe_model_dir)
    gens = eng.generate(PROMPTS[:2], SamplingParams(max_tokens=5, temperature=1.0, seed=0))
    for g in gens:
        experts = torch.tensor(g.routed_experts)
        assert experts.shape == (5, 2, 2)  # tokens x layers x top-k
        assert experts.min() >= 0 and experts.max() < 4
        ref = teacher_forced_logprobs(eng.model, PROMPTS[0], gens[0].token_ids, 1.0)
    assert torch.allclose(torch.tensor(gens[0].logprobs), ref, atol=1e-4)


def test_load_checkpoint_swaps_weights(engine, tmp_path):
    from app.checkpoints.testing import build_tiny_model

    other = build_tiny_model(tmp_path / "other", seed=1)
    eng = TorchEngine(engine.model_dir, checkpoint_id="a")
    before = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    eng.load_checkpoint("b", other)
    after = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert eng.checkpoint_id == "b" and before.token_ids != after.token_ids


def test_apply_delta_serves_the_same_weights_as_a_full_load(tiny_model_dir, tmp_path):
    from app.checkpoints.delta import serving_state_dict, write_delta
    from app.checkpoints.testing import build_tiny_model
    from app.core.errors import CheckpointError

    child_dir = tmp_path / "child"
    build_tiny_model(child_dir, seed=0)
    from transformers import AutoModelForCausalLM

    parent = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    child = AutoModelForCausalLM.from_pretrained(child_dir)
    with torch.no_grad():  # a small "training step": nudge a few weights
        child.model.layers[0].mlp.up_proj.weight[:3] += 0.05
    child.save_pretrained(child_dir)
    write_delta(
        serving_state_dict(parent),
        serving_state_dict(child),
        child_dir / "delta.zst",
        parent_id="parent",
        checkpoint_id="child",
    )

    via_delta = TorchEngine(tiny_model_dir, checkpoint_id="parent")
    with pytest.raises(CheckpointError, match="serves parent"):
        via_delta.apply_delta("child", child_dir / "delta.zst", parent_id="other")
    via_delta.apply_delta("child", child_dir / "delta.zst", parent_id="parent")
    full = TorchEngine(child_dir, checkpoint_id="child")
    assert via_delta.checkpoint_id == "child"
    for (name, a), (_, b) in zip(via_delta.model.state_dict().items(), full.model.state_dict().items()):
        assert torch.equal(a, b), name
    params = SamplingParams(max_tokens=5, temperature=0.0)
    assert via_delta.generate(PROMPTS, params)[0].token_ids == full.generate(PROMPTS, params)[0].token_ids

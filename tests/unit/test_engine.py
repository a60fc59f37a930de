"""The reference engine: behaviour log-probs equal a teacher-forced forward pass; seeds, stops, routes, reloads."""

from __future__ import annotations

import pytest
import torch

from app.inference.engine import SamplingParams
from serving.engine import setup_engine
from serving.reference_engine import ReferenceEngine, teacher_forced_logprobs

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200], [1, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15]]


@pytest.fixture(scope="module")
def engine(tiny_model_dir) -> ReferenceEngine:
    torch.set_num_threads(1)  # a tiny model: one thread is fastest on a shared CPU (docs/serving.md)
    return ReferenceEngine(tiny_model_dir, checkpoint_id="tiny", num_threads=1)


@pytest.mark.parametrize("temperature,top_p", [(0.0, 1.0), (0.7, 1.0), (1.0, 1.0)])
def test_logprobs_match_a_teacher_forced_pass(engine, temperature, top_p):
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


def test_top_p_logprobs_are_of_the_renormalised_nucleus(engine):
    """Top-p log-probs are the tempered ones renormalised over the nucleus: never below them, and
    above them by the same log-mass at a step whose nucleus excludes something."""
    (gen,) = engine.generate([PROMPTS[0]], SamplingParams(max_tokens=10, temperature=1.0, top_p=0.5, seed=1))
    full = teacher_forced_logprobs(engine.model, PROMPTS[0], gen.token_ids, 1.0)
    assert all(lp >= f - 1e-5 for lp, f in zip(gen.logprobs, full.tolist()))
    assert all(lp <= 1e-6 for lp in gen.logprobs)


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
    eng = setup_engine(engine="reference", model_dir=tiny_model_dir, checkpoint_id="x")
    assert eng.checkpoint_id == "x" and eng.tokenizer.eos_token_id == 2


def test_moe_reports_routed_experts(tiny_moe_model_dir):
    eng = ReferenceEngine(tiny_moe_model_dir, num_threads=1)
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
    eng = ReferenceEngine(engine.model_dir, checkpoint_id="a", num_threads=1)
    before = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    eng.load_checkpoint("b", other)
    after = eng.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert eng.checkpoint_id == "b" and before.token_ids != after.token_ids

"""Router replay (R3) on tiny MoE models: the trainer's forward pass with the serving engine's routes
reproduces the serving log-probs; routes sit one position left of the token they sampled; gate
weights come from the trainer's own router; a dense model and ``router_replay = false`` are the
forward pass without replay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from app.inference.engine import SamplingParams
from serving.reference_engine import ReferenceEngine
from trainer.batching import pack_micro_batches
from trainer.config import TrainerConfig
from trainer.router_replay import moe_routers, replay_routes
from trainer.step import token_logprobs
from trainer.testing import build_tiny_moe, make_segment, make_trajectory

PROMPTS = [[1] + list(range(200 + 11 * i, 230 + 11 * i)) for i in range(6)]
CONFIG = TrainerConfig.model_validate({"loss": {"temperature": 1.0}})


@pytest.fixture(scope="module")
def moe_dir(tmp_path_factory):
    """Mixtral-style, 8 experts top-2, 4 layers: big enough that bf16 serving weights change routes."""
    return build_tiny_moe(tmp_path_factory.mktemp("moe8"), seed=0)


@pytest.fixture(scope="module")
def served(moe_dir):
    """(engine, generations) from the reference engine serving bf16-rounded weights."""
    torch.set_num_threads(1)
    engine = ReferenceEngine(moe_dir, num_threads=1)
    gens = engine.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=1.0, seed=0))
    return engine, gens


def _batch(gens, shift: int = 0):
    """One micro-batch of the generations as stored segments (routes rolled by ``shift`` tokens)."""
    segs = []
    for p, g in zip(PROMPTS, gens):
        seg = make_segment(p, g.token_ids, np.array([0.0] * len(p) + g.logprobs))
        routes = np.full((len(seg.token_ids), *np.shape(g.routed_experts)[1:]), -1, dtype=np.int32)
        routes[len(p) :] = np.roll(np.asarray(g.routed_experts), shift, axis=0)
        seg.routed_experts = routes
        segs.append(seg)
    trajs = [make_trajectory([s], 0.0) for s in segs]
    [mb] = pack_micro_batches(trajs, torch.zeros(len(trajs)), micro_batch_tokens=10_000, pad_id=2)
    return mb


def _logprobs(model, mb, replay: bool = True) -> torch.Tensor:
    config = CONFIG.model_copy(update={"router_replay": replay})
    with torch.no_grad():
        return token_logprobs(model, mb, config)[0]


def _mismatch_kl(lp: torch.Tensor, mu: torch.Tensor) -> float:
    log_is = lp - mu
    return float((torch.expm1(log_is) - log_is).mean())


def test_forced_routes_reproduce_the_serving_logprobs(served):
    engine, gens = served
    mb = _batch(gens)
    assert mb.routes is not None and mb.routes.shape[2:] == (4, 2)
    # the serving weights themselves: replay gives the serving log-probs, routes one token late do not
    lp = _logprobs(engine.model, mb)
    assert torch.allclose(lp, mb.behaviour_logprobs, atol=1e-4)
    wrong = _logprobs(engine.model, _batch(gens, shift=1))
    assert (wrong - mb.behaviour_logprobs).abs().max() > 1e-2


def test_replay_removes_most_of_the_bf16_fp32_mismatch(moe_dir, served):
    from transformers import AutoModelForCausalLM

    _, gens = served
    trainer = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()  # fp32, not rounded
    mb = _batch(gens)
    chosen: list[torch.Tensor] = []
    experts = [layer.mlp.experts for layer in trainer.model.layers]  # what the experts were handed
    hooks = [e.register_forward_pre_hook(lambda m, args: chosen.append(args[1])) for e in experts]
    with_replay = _logprobs(trainer, mb)
    for h in hooks:
        h.remove()
    # every replayed position ran exactly the recorded experts
    ids = torch.stack(chosen, dim=1).reshape(*mb.routes.shape)
    forced = mb.routes >= 0
    assert forced.any() and torch.equal(ids[forced], mb.routes[forced])
    without = _logprobs(trainer, mb, replay=False)
    kl_with, kl_without = _mismatch_kl(with_replay, mb.behaviour_logprobs), _mismatch_kl(without, mb.behaviour_logprobs)
    # the rest is dense bf16 error (bench/router_replay.py measures the 5x target on more tokens)
    assert kl_without > 0 and kl_with <= kl_without / 3, (kl_with, kl_without)


def test_gate_weights_are_the_trainers_own_and_carry_gradients(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    router = moe_routers(model)[0]
    hidden = torch.randn(5, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    routes = torch.tensor([[0, 1], [2, 3], [-1, -1], [7, 4], [5, 6]])
    full = torch.full((1, 5, len(moe_routers(model)), 2), -1, dtype=torch.long)
    full[0, :, 0] = routes
    plain_logits, plain_w, plain_ids = router(hidden)
    with replay_routes(model, full):
        logits, weights, ids = router(hidden)
    probs = torch.softmax(logits, -1)
    for row in (0, 1, 3, 4):
        assert ids[row].tolist() == routes[row].tolist()
        expect = probs[row, routes[row]] / probs[row, routes[row]].sum()  # Mixtral renormalises its top-k
        assert torch.allclose(weights[row], expect, atol=1e-6)
    assert torch.equal(ids[2], plain_ids[2]) and torch.allclose(weights[2], plain_w[2])
    weights[:, 0].sum().backward()  # each row's renormalised weights sum to 1: differentiate one of them
    assert router.weight.grad is not None and router.weight.grad.abs().sum() > 0
    _, _, after = router(hidden)  # the hook is gone after the block
    assert torch.equal(after, plain_ids)


def test_qwen2_moe_keeps_its_unnormalised_weights(tmp_path):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(build_tiny_moe(tmp_path / "q", kind="qwen2_moe"), dtype=torch.float32)
    routers = moe_routers(model)
    assert len(routers) == 4 and not routers[0].norm_topk_prob
    hidden = torch.randn(3, model.config.hidden_size)
    full = torch.full((1, 3, 4, 2), -1, dtype=torch.long)
    full[0, :, 2] = torch.tensor([[6, 1], [0, 7], [3, 2]])
    with replay_routes(model, full):
        logits, weights, ids = routers[2](hidden)
    assert ids.tolist() == [[6, 1], [0, 7], [3, 2]]
    assert torch.allclose(weights, torch.softmax(logits, -1).gather(-1, ids), atol=1e-6)


def test_switch_off_is_the_forward_pass_without_routes(moe_dir, served):
    from transformers import AutoModelForCausalLM

    _, gens = served
    trainer = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32).eval()
    mb = _batch(gens)
    off = _logprobs(trainer, mb, replay=False)
    mb_plain = _batch(gens)
    mb_plain.routes = None
    assert torch.equal(off, _logprobs(trainer, mb_plain))
    assert not torch.equal(off, _logprobs(trainer, mb))  # replay changes what the routes differ on


def test_dense_model_is_unaffected():
    from trainer.testing import tiny_policy

    model = tiny_policy().eval()
    assert moe_routers(model) == []
    seg = make_segment([1, 5, 6, 7], [8, 9, 10])
    seg.routed_experts = np.zeros((7, 2, 2), dtype=np.int32)
    [mb] = pack_micro_batches([make_trajectory([seg], 1.0)], torch.ones(1), micro_batch_tokens=64)
    with_routes = _logprobs(model, mb)
    mb.routes = None
    assert torch.equal(with_routes, _logprobs(model, mb))


def test_routes_that_do_not_fit_the_model_are_refused(moe_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
    ids = torch.tensor([[1, 2, 3]])
    for bad, match in (
        (torch.zeros(1, 3, 3, 2, dtype=torch.long), "MoE layers"),
        (torch.full((1, 3, 4, 2), 8, dtype=torch.long), "expert 8"),
        (torch.zeros(1, 4, 4, 2, dtype=torch.long), "routes cover"),
    ):
        with pytest.raises(ValueError, match=match), replay_routes(model, bad):
            model(input_ids=ids)


def test_activation_checkpointing_recomputes_under_the_replayed_routes(moe_dir, served):
    from transformers import AutoModelForCausalLM

    from trainer.router_replay import checkpoint_contexts

    _, gens = served
    mb = _batch(gens)

    def grads(checkpointing: dict | None) -> torch.Tensor:
        model = AutoModelForCausalLM.from_pretrained(moe_dir, dtype=torch.float32)
        if checkpointing is not None:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpointing)
        model.train()
        token_logprobs(model, mb, CONFIG)[0].sum().backward()
        return torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.grad is not None])

    plain = grads(None)
    with_contexts = grads({"use_reentrant": False, "context_fn": checkpoint_contexts})
    assert torch.allclose(with_contexts, plain, rtol=1e-4, atol=1e-6)
    # without them the recompute routes by the trainer's own router: torch notices when that runs
    # another number of experts, else the gradients are of another forward pass
    try:
        without = grads({"use_reentrant": False})
    except torch.utils.checkpoint.CheckpointError:
        return
    assert not torch.allclose(without, plain, rtol=1e-4, atol=1e-6)

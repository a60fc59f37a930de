"""Shared-prefix micro-batches (``data.share_prefixes``): a task group's common prompt is computed once,
every trainable token is still trained exactly once, and the log-probs, loss and gradients equal
those of whole rows; groups without a usable common prefix, MoE routes and activation
checkpointing fall back to whole rows."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.batching import MIN_SHARED_PREFIX, pack_micro_batches, shared_prefix_length
from trainer.config import TrainerConfig
from trainer.step import micro_batch_loss, token_logprobs, use_behaviour_logprobs
from trainer.testing import make_segment, make_trajectory, tiny_policy
from trainer.training import pack_cycle


def _cycle(seed: int = 0) -> list:
    """4 task groups of 4 sessions: a shared 20-40-token prompt, completions of 3-25 tokens (two
    turns for some); one group whose prompts differ at token 5 (nothing worth sharing)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(4):
        prompt = [1, *rng.integers(10, 500, int(rng.integers(20, 40))).tolist()]
        for s in range(4):
            own = list(prompt) if g < 3 else prompt[:5] + rng.integers(10, 500, 20).tolist()
            completion = rng.integers(10, 500, int(rng.integers(3, 25))).tolist() + [2]
            seg = make_segment(own, completion, rng.normal(-1, 0.3, len(own) + len(completion)).astype(np.float32))
            if s % 2:  # a second turn: the developer's follow-up (context), then more sampled tokens
                follow = rng.integers(10, 500, 6).tolist()
                more = rng.integers(10, 500, 5).tolist() + [2]
                ids = np.concatenate([seg.token_ids, follow, more]).astype(np.int32)
                mask = np.concatenate([seg.loss_mask, np.zeros(6), np.ones(6)]).astype(np.uint8)
                mu = np.concatenate([seg.behaviour_logprobs, np.zeros(6), rng.normal(-1, 0.3, 6)]).astype(np.float32)
                seg = type(seg)(token_ids=ids, loss_mask=mask, behaviour_logprobs=mu * mask)
            out.append(make_trajectory([seg], float(rng.random()), task_id=f"task-{g}"))
    return out


def _config(share: bool, **kw) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "logprob_chunk_size": 16,
            "data": {"micro_batch_tokens": 400, "share_prefixes": share},
            "loss": {"temperature": 0.7},
            **kw,
        }
    )


def _per_token(batches, values) -> dict:
    """``{(trajectory, occurrence): value}`` for every trainable token, in row order."""
    out, seen = {}, {}
    for mb, v in zip(batches, values):
        for t, x in zip(mb.trajectory_index.tolist(), v.tolist()):
            k = seen[t] = seen.get(t, -1) + 1
            out[(t, k)] = x
    return out


def test_each_trainable_token_is_packed_once_and_a_groups_prompt_once_per_micro_batch():
    trajectories = _cycle()
    _, _, adv, whole = pack_cycle(trajectories, _config(False))
    _, _, _, shared = pack_cycle(trajectories, _config(True))
    assert all(mb.prefix_ids is None for mb in whole) and all(mb.prefix_ids is not None for mb in shared)
    assert _per_token(whole, [mb.targets for mb in whole]) == _per_token(shared, [mb.targets for mb in shared])
    assert sum(mb.num_tokens for mb in shared) == sum(mb.num_tokens for mb in whole)  # rows' tokens
    assert sum(mb.computed_tokens for mb in shared) < 0.75 * sum(mb.num_tokens for mb in whole)
    for mb in shared:
        full = mb.attention_mask.sum(1) + mb.prefix_lengths  # each row's whole length
        assert len(full) == 1 or len(full) * int(full.max()) <= 400  # the whole-row budget
        assert int(mb.prefix_gather.max()) < mb.prefix_ids.shape[1] and mb.prefix_ids.shape[0] == 1
        assert torch.equal(mb.prefix_mask.sum(1), mb.prefix_lengths)
        assert int(mb.hidden_index.min()) >= 0  # every predicting position lies in the suffix
    # the group whose prompts differ at token 5 keeps its rows' own prompts (one prefix per row)
    differing = [s for t in trajectories[12:] for s in t.segments]
    assert shared_prefix_length(differing) == 5 < MIN_SHARED_PREFIX
    assert shared_prefix_length(differing[:1]) == 0


def test_shared_prefix_log_probs_loss_and_gradients_equal_whole_rows():
    torch.manual_seed(0)
    model = tiny_policy(seed=1)
    trajectories = _cycle(seed=1)
    results = {}
    for share in (False, True):
        config = _config(share)
        *_, batches = pack_cycle(trajectories, config, pad_id=2)
        use_behaviour_logprobs(batches)
        model.zero_grad(set_to_none=True)
        with torch.no_grad():
            logprobs = _per_token(batches, [token_logprobs(model, mb, config)[0] for mb in batches])
        loss = sum(micro_batch_loss(model, mb, config)[0] for mb in batches)
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters()}
        results[share] = (logprobs, float(loss.detach()), grads)
    (lp0, loss0, g0), (lp1, loss1, g1) = results[False], results[True]
    assert lp0.keys() == lp1.keys()
    assert max(abs(lp0[k] - lp1[k]) for k in lp0) < 1e-4
    assert loss1 == pytest.approx(loss0, rel=1e-4, abs=1e-6)
    for name in g0:
        assert torch.allclose(g1[name], g0[name], rtol=1e-3, atol=1e-6), name
    assert any(float(g.abs().sum()) > 0 for g in g0.values())


def test_rows_without_a_prefix_to_share_train_as_whole_rows():
    """A row sampled from its second token on has an empty prefix: alone in its micro-batch it is
    packed whole, beside others its prefix is empty; either way its log-probs are those of whole rows."""
    model = tiny_policy(seed=2)
    trajectories = [make_trajectory([make_segment([1], [40 + k, 41, 2])], float(k), task_id="t") for k in range(2)]
    trajectories += _cycle(seed=2)[:4]
    for cycle, budget in ((trajectories[:2], 400), (trajectories, 4000)):
        out = []
        for share in (False, True):
            config = _config(share, data={"micro_batch_tokens": budget, "share_prefixes": share})
            *_, batches = pack_cycle(cycle, config, pad_id=2)
            with torch.no_grad():
                out.append(_per_token(batches, [token_logprobs(model, mb, config)[0] for mb in batches]))
        assert out[0].keys() == out[1].keys() and max(abs(out[0][k] - out[1][k]) for k in out[0]) < 1e-4


def test_routes_and_activation_checkpointing_pack_whole_rows():
    trajectories = _cycle()
    *_, batches = pack_cycle(trajectories, _config(True, gradient_checkpointing=True))
    assert all(mb.prefix_ids is None for mb in batches)
    seg = trajectories[0].segments[0]
    seg.routed_experts = np.full((len(seg.token_ids), 2, 2), -1, dtype=np.int32)
    batches = pack_micro_batches(
        trajectories, torch.zeros(len(trajectories)), micro_batch_tokens=240, share_prefixes=True
    )
    assert all(mb.prefix_ids is None for mb in batches)

"""Learning, not just running: the trainer raises a toy environment's mean reward on fresh samples.

The environment: a fixed prompt, 4 sampled tokens, reward = share of them in a target set (1/8 of
the vocabulary). Each round samples a group from the current policy (behaviour log-probs recorded at
sampling time, as the engine does), trains one cycle on it with the production code path (advantages,
packing, pi_old pass, clipped IS-weighted loss, AdamW), then measures the mean reward on held-out
samples from another seed. The test fails if the update is a no-op (lr 0) or has the wrong sign.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.batching import group_ids, pack_micro_batches
from trainer.config import TrainerConfig
from trainer.loss import compute_advantages
from trainer.step import compute_old_logprobs, make_optimizer, train_steps
from trainer.testing import make_segment, make_trajectory, tiny_policy

PROMPT = [1, 40, 41]
NEW_TOKENS, TARGET = 4, 64  # reward: share of sampled ids below TARGET (vocab 512 -> 1/8 at random)


@torch.no_grad()
def sample(model, n: int, seed: int, temperature: float = 1.0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens [n, NEW_TOKENS] int64, behaviour log-probs [n, NEW_TOKENS] fp32)`` at ``temperature``."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.tensor([PROMPT] * n)
    logps = []
    for _ in range(NEW_TOKENS):
        logp = torch.log_softmax(model(input_ids=ids).logits[:, -1, :].float() / temperature, dim=-1)
        tok = torch.multinomial(logp.exp(), 1, generator=g)
        logps.append(logp.gather(-1, tok))
        ids = torch.cat([ids, tok], dim=1)
    return ids[:, len(PROMPT) :], torch.cat(logps, dim=1)


def reward(tokens: torch.Tensor) -> torch.Tensor:
    """``[n]`` fp32 share of each row's tokens below ``TARGET``."""
    return (tokens < TARGET).float().mean(dim=1)


def train_rounds(lr: float, sign: float, rounds: int = 5) -> tuple[float, float]:
    torch.manual_seed(0)
    model = tiny_policy(seed=0)
    model.eval()
    before = float(reward(sample(model, 512, seed=10_000)[0]).mean())
    config = TrainerConfig.model_validate(
        {
            "grad_accum": 2,
            "epochs": 2,
            "logprob_chunk_size": 64,
            "data": {"micro_batch_tokens": 64},
            "loss": {"temperature": 1.0},
            "optim": {"lr": lr},
        }
    )
    for r in range(rounds):
        tokens, behaviour = sample(model, 32, seed=r)
        rewards = sign * reward(tokens)
        trajectories = []
        for row, (toks, lp) in enumerate(zip(tokens.tolist(), behaviour)):
            full = np.concatenate([np.zeros(len(PROMPT)), lp.numpy()]).astype(np.float32)
            trajectories.append(make_trajectory([make_segment(PROMPT, toks, full)], float(rewards[row]), task_id="t"))
        advantages = compute_advantages(rewards, group_ids(trajectories))
        batches = pack_micro_batches(trajectories, advantages, micro_batch_tokens=64, pad_id=2, seed=r)
        compute_old_logprobs(model, batches, config)
        train_steps(model, batches, config, make_optimizer(model, config))
        model.eval()
    after = float(reward(sample(model, 512, seed=10_000)[0]).mean())
    return before, after


def test_training_raises_the_mean_reward_on_fresh_samples():
    before, after = train_rounds(lr=1e-2, sign=1.0)
    assert after > before + 0.1, (before, after)


def test_inverted_reward_lowers_it_and_a_zero_step_changes_nothing():
    before, inverted = train_rounds(lr=1e-2, sign=-1.0)
    assert inverted < before - 0.05, (before, inverted)
    before0, after0 = train_rounds(lr=1e-12, sign=1.0, rounds=1)
    assert after0 == pytest.approx(before0, abs=1e-3)

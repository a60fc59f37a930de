"""The trainer refuses a non-finite loss: a micro-batch whose behaviour log-probs hold a NaN (what an
implausible event would have brought) is skipped and counted, and the weights stay finite."""

from __future__ import annotations

import math

import torch

from trainer.batching import group_ids, pack_micro_batches
from trainer.config import TrainerConfig
from trainer.loss import compute_advantages
from trainer.step import compute_old_logprobs, make_optimizer, train_steps
from trainer.testing import make_segment, make_trajectory, sequence_logprobs, tiny_policy

PROMPT = [1, 40, 41, 42, 43]
GOOD = [100, 101, 102, 103, 104, 2]
BAD = [200, 201, 202, 203, 204, 2]


def _batches(model, poison: bool):
    trajectories = []
    for k in range(3):
        for completion, reward in ((GOOD, 1.0), (BAD, 0.0)):
            behaviour = sequence_logprobs(model, PROMPT + completion, 1.0).copy()
            if poison and k == 0 and reward == 1.0:
                behaviour[len(PROMPT) + 1] = float("nan")
            trajectories.append(make_trajectory([make_segment(PROMPT, completion, behaviour)], reward, task_id="t"))
    adv = compute_advantages(torch.tensor([t.reward for t in trajectories]), group_ids(trajectories))
    return pack_micro_batches(trajectories, adv, micro_batch_tokens=22, pad_id=2)


def test_a_nan_micro_batch_is_skipped_and_the_weights_stay_finite():
    torch.manual_seed(0)
    model = tiny_policy(seed=0)
    config = TrainerConfig.model_validate(
        {
            "grad_accum": 1,
            "epochs": 1,
            "logprob_chunk_size": 5,
            "data": {"micro_batch_tokens": 22},
            "optim": {"lr": 3e-3},
        }
    )
    batches = _batches(model, poison=True)
    compute_old_logprobs(model, batches, config)
    history = train_steps(model, batches, config, make_optimizer(model, config))

    skipped = sum(h.skipped_micro_batches for h in history)
    assert skipped >= 1 and any(h.skipped_step for h in history)
    assert all(math.isfinite(h.loss) for h in history)
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not h.skipped_step for h in history)  # the clean micro-batches still trained


def test_clean_batches_skip_nothing():
    torch.manual_seed(0)
    model = tiny_policy(seed=0)
    config = TrainerConfig.model_validate(
        {
            "grad_accum": 1,
            "epochs": 1,
            "logprob_chunk_size": 5,
            "data": {"micro_batch_tokens": 22},
            "optim": {"lr": 3e-3},
        }
    )
    batches = _batches(model, poison=False)
    compute_old_logprobs(model, batches, config)
    history = train_steps(model, batches, config, make_optimizer(model, config))
    assert len(history) == len(batches) >= 2
    assert all(h.skipped_micro_batches == 0 for h in history) and not any(h.skipped_step for h in history)

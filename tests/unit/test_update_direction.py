"""One optimizer step moves log-probs the way the advantages say (and the opposite way with
``invert_reward``), in both pi_old modes and both precisions; the update watch stops a cycle whose
learning rate is absurd, records why, and leaves the weights as the last accepted step left them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.device import Placement
from trainer.metrics import summarize
from trainer.step import (
    compute_old_logprobs,
    make_optimizer,
    token_logprobs,
    train_steps,
    use_behaviour_logprobs,
)
from trainer.testing import BAD, GOOD, good_bad_trajectories, tiny_policy
from trainer.training import pack_cycle

FP32 = Placement(device=torch.device("cpu"))
BF16 = Placement(device=torch.device("cpu"), compute_dtype=torch.bfloat16)


def _config(**kw) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "epochs": 1,
            "grad_accum": 8,
            "logprob_chunk_size": 16,
            "data": {"micro_batch_tokens": 20},  # 2 rows per micro-batch
            "loss": {"temperature": 1.0},
            "optim": {"lr": 1e-3},
            **kw,
        }
    )


def _prepare(model, trajectories, config, placement=None):
    *_, batches = pack_cycle(trajectories, config, pad_id=2)
    if config.pi_old == "behaviour":
        use_behaviour_logprobs(batches)
    else:
        compute_old_logprobs(model, batches, config, placement=placement)
    return batches


def _logprob_change_by_advantage(model, batches, config, step) -> tuple[float, float]:
    """Mean change of the trained tokens' fp32 log-probs over one ``step()``: ``(positive-advantage
    tokens, negative-advantage tokens)``, by the rewards before any inversion."""

    @torch.no_grad()
    def logprobs():
        model.eval()
        return [token_logprobs(model, mb, config)[0] for mb in batches]

    before = logprobs()
    step()
    after = logprobs()
    delta = torch.cat([a - b for a, b in zip(after, before)])
    targets = torch.cat([mb.targets for mb in batches])
    good, bad = torch.isin(targets, torch.tensor(GOOD[:-1])), torch.isin(targets, torch.tensor(BAD[:-1]))
    assert good.sum() == bad.sum() > 0
    return float(delta[good].mean()), float(delta[bad].mean())


@pytest.mark.parametrize("placement", [FP32, BF16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("pi_old", ["recompute", "behaviour"])
@pytest.mark.parametrize("invert_reward", [False, True], ids=["reward", "inverted"])
def test_one_step_raises_positive_advantage_tokens_and_lowers_negative_ones(placement, pi_old, invert_reward):
    model = tiny_policy(seed=0)
    config = _config(pi_old=pi_old, invert_reward=invert_reward)
    batches = _prepare(model, good_bad_trajectories(model), config, placement)
    assert {round(float(a), 3) for mb in batches for a in mb.advantages} == {0.5, -0.5}
    optimizer = make_optimizer(model, config)
    history = []

    def step():
        history.extend(train_steps(model, batches, config, optimizer, placement=placement))

    good, bad = _logprob_change_by_advantage(model, batches, config, step)
    assert len(history) == 1 and not history[0].skipped_step and history[0].grad_norm > 0
    sign = -1.0 if invert_reward else 1.0
    # Adam's first step moves every weight by about lr: a no-op or an inverted sign fails both
    assert sign * good > 0.05, (good, bad)
    assert sign * bad < -0.05, (good, bad)


def _lr_watch_run(lr: float, **kw):
    model = tiny_policy(seed=0)
    config = _config(grad_accum=1, optim={"lr": lr}, **kw)  # 2 micro-batches: 2 steps planned
    batches = _prepare(model, good_bad_trajectories(model), config)
    assert len(batches) == 2
    after_step: dict[int, dict] = {}

    def on_step(m):
        after_step[m.step] = copy.deepcopy(model.state_dict())

    initial = copy.deepcopy(model.state_dict())
    history = train_steps(model, batches, config, make_optimizer(model, config), on_step=on_step)
    return history, initial, after_step, model.state_dict()


def test_update_watch_stops_a_cycle_with_an_absurd_learning_rate():
    history, initial, after_step, final = _lr_watch_run(1e-2, max_kl_per_token=0.05)
    # step 1's forward is at the parent (kl 0); its update at lr 1e-2 is what step 2's forward measures
    assert len(history) == 2 and history[0].stopped_early is None and history[0].kl == pytest.approx(0, abs=1e-5)
    stopped = history[1]
    assert stopped.kl > 0.05 and stopped.skipped_step
    assert "max_kl_per_token" in stopped.stopped_early and f"{stopped.kl:.4g}" in stopped.stopped_early
    for k, v in final.items():  # the stopped step took no update
        assert torch.equal(v, after_step[1][k]), k
    assert any(not torch.equal(final[k], initial[k]) for k in final)
    summary = summarize(history, data={}, mismatch={}, seconds=1.0)
    assert summary["stopped_early"] == {"step": 2, "reason": stopped.stopped_early}


def test_update_watch_lets_a_sane_cycle_run_and_stops_on_entropy():
    history, *_ = _lr_watch_run(1e-5, max_kl_per_token=0.05)
    assert len(history) == 2 and all(m.stopped_early is None and not m.skipped_step for m in history)
    assert summarize(history, data={}, mismatch={}, seconds=1.0)["stopped_early"] is None
    entropy = float(np.log(512))  # a random tiny policy is close to uniform over its 512 tokens
    history, initial, _, final = _lr_watch_run(1e-5, min_entropy=entropy + 1.0)
    assert len(history) == 1 and "min_entropy" in history[0].stopped_early and history[0].skipped_step
    assert all(torch.equal(final[k], initial[k]) for k in final)  # stopped before its first update


def test_the_watched_kl_is_the_behaviour_kl_when_pi_old_is_mu():
    """With pi_old = mu the watch's KL(pi_old || pi_theta) and KL(mu || pi_theta) are one estimate
    of one quantity from the same sampled tokens."""
    history, *_ = _lr_watch_run(1e-2, pi_old="behaviour")
    assert history[1].kl > 0.01 and history[1].kl == pytest.approx(history[1].behaviour_kl, rel=1e-4)

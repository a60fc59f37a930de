"""``pi_old = "behaviour"`` (trainer/step.py, trainer/loss.py): with behaviour log-probs equal to the
trainer's own (fp32) log-probs, skipping the recompute pass gives the same loss, gradients, metrics
and trained weights as recomputing pi_old; with a serving mismatch it does not; and the mode is
refused with more than one epoch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

from app.core.errors import ConfigurationError
from trainer.config import TrainerConfig, load_config
from trainer.step import (
    compute_old_logprobs,
    make_optimizer,
    micro_batch_loss,
    train_steps,
    use_behaviour_logprobs,
)
from trainer.testing import make_segment, make_trajectory, sequence_logprobs, tiny_policy
from trainer.training import pack_cycle

TEMPERATURE = 0.7


def _trajectories(model, shift: float = 0.0):
    """Two tasks x (rewarded, unrewarded) completions, behaviour log-probs = the model's own at
    ``TEMPERATURE`` (plus ``shift`` nats: a serving engine that disagrees)."""
    rng = np.random.default_rng(0)
    out = []
    for task in range(2):
        prompt = [1, *rng.integers(3, 500, size=6).tolist()]
        for reward in (1.0, 0.0):
            completion = [*rng.integers(3, 500, size=5 + 2 * task).tolist(), 2]
            mu = sequence_logprobs(model, prompt + completion, TEMPERATURE) + np.float32(shift)
            out.append(make_trajectory([make_segment(prompt, completion, mu)], reward, task_id=f"t{task}"))
    return out


def _config(pi_old: str) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "pi_old": pi_old,
            "epochs": 1,
            "grad_accum": 1,
            "logprob_chunk_size": 8,
            "data": {"micro_batch_tokens": 32},  # 2 rows per micro-batch: 2 micro-batches, 2 steps
            "loss": {"temperature": TEMPERATURE},
            "optim": {"lr": 1e-3, "eps": 1e-6},
        }
    )


def _batches(model, trajectories, config):
    *_, batches = pack_cycle(trajectories, config, pad_id=2)
    if config.pi_old == "behaviour":
        use_behaviour_logprobs(batches)
    else:
        compute_old_logprobs(model, batches, config)
    return batches


def _loss_and_grads(model, mb, config):
    model.zero_grad(set_to_none=True)
    loss, sums = micro_batch_loss(model, mb, config)
    loss.backward()
    return loss.detach(), sums, {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_behaviour_logprobs_as_pi_old_match_a_recomputed_pi_old():
    model = tiny_policy(seed=1)
    trajectories = _trajectories(model)
    recompute, behaviour = _config("recompute"), _config("behaviour")
    by_recompute = _batches(model, trajectories, recompute)
    by_behaviour = _batches(model, trajectories, behaviour)
    assert len(by_recompute) == 2 and all(mb.old_logprobs is mb.behaviour_logprobs for mb in by_behaviour)
    for mb_r, mb_b in zip(by_recompute, by_behaviour):
        loss_r, sums_r, grads_r = _loss_and_grads(model, mb_r, recompute)
        loss_b, sums_b, grads_b = _loss_and_grads(model, mb_b, behaviour)
        torch.testing.assert_close(loss_b, loss_r, rtol=1e-4, atol=1e-7)
        assert grads_b.keys() == grads_r.keys()
        assert max(float(g.abs().max()) for g in grads_r.values()) > 1e-3  # equal gradients mean something
        for name, grad in grads_r.items():
            torch.testing.assert_close(grads_b[name], grad, rtol=1e-3, atol=1e-6, msg=name)
        assert sums_b["is_clipped"] == sums_r["is_clipped"] == 0
        assert sums_b["behaviour_kl_sum"] == pytest.approx(0.0, abs=1e-4)  # mu is the model's own

    # a whole cycle of two steps: the second step's ratio is against mu instead of the recomputed
    # parent, which are equal here, so the trained weights are too
    trained = {}
    for config, batches in ((recompute, by_recompute), (behaviour, by_behaviour)):
        policy = copy.deepcopy(model)
        history = train_steps(policy, batches, config, make_optimizer(policy, config))
        assert len(history) == 2 and history[1].kl > 0
        trained[config.pi_old] = (history, policy.state_dict())
    (hist_r, state_r), (hist_b, state_b) = trained["recompute"], trained["behaviour"]
    for m_r, m_b in zip(hist_r, hist_b):
        assert m_b.loss == pytest.approx(m_r.loss, rel=1e-3, abs=1e-6)
        assert m_b.kl == pytest.approx(m_r.kl, rel=1e-2, abs=1e-7)
    moved = max(float((state_r[k] - model.state_dict()[k]).abs().max()) for k in state_r)
    assert moved > 5e-4
    for k in state_r:
        torch.testing.assert_close(state_b[k], state_r[k], rtol=0, atol=1e-5, msg=k)


def test_a_serving_mismatch_is_clipped_and_truncated_in_behaviour_mode():
    """mu 1 nat below the trainer's log-probs (r = e on every token, C = 2): recompute weights every
    token by min(pi_old / mu, C) = 2 at ratio 1; behaviour takes r = e against mu, so a positive
    advantage sits on the clipped branch and a negative one gets weight min(r, C) = 2 (module
    docstring of trainer/loss.py); step 1's KL(mu || pi_theta) reports the mismatch, e - 2 per token."""
    model = tiny_policy(seed=1)
    trajectories = _trajectories(model, shift=-1.0)
    recompute, behaviour = _config("recompute"), _config("behaviour")
    mb_r, mb_b = _batches(model, trajectories, recompute)[0], _batches(model, trajectories, behaviour)[0]
    loss_r, sums_r, _ = _loss_and_grads(model, mb_r, recompute)
    loss_b, sums_b, _ = _loss_and_grads(model, mb_b, behaviour)
    adv, z, e = mb_b.advantages.double(), recompute.normalizer(), float(np.e)
    assert float(loss_r) == pytest.approx(float(-2.0 * adv.sum()) / z, rel=1e-4)
    expected = torch.where(adv > 0, -1.2 * (2.0 / e) * adv, -2.0 * adv).sum()  # s = C / r = 2 / e
    assert float(loss_b) == pytest.approx(float(expected) / z, rel=1e-4)
    n = mb_b.num_trainable
    assert sums_b["behaviour_kl_sum"] == pytest.approx((e - 2.0) * n, rel=1e-3)
    assert sums_r["mismatch_kl_sum"] == pytest.approx((e - 2.0) * n, rel=1e-3) and sums_b["mismatch_kl_sum"] == 0.0
    assert sums_r["is_clipped"] == sums_b["is_clipped"] == n  # pi_old / mu, resp. pi_theta / mu, above C
    assert sums_b["ppo_clipped"] == int((adv > 0).sum()) > 0 and sums_r["ppo_clipped"] == 0


def test_behaviour_pi_old_is_refused_with_several_epochs():
    assert load_config(overrides={"pi_old": "recompute", "epochs": 2}).pi_old == "recompute"
    assert load_config().pi_old == "behaviour" and load_config().epochs == 1  # the shipped defaults
    with pytest.raises(ConfigurationError) as err:
        load_config(overrides={"epochs": 2})  # behaviour by default: several epochs need recompute
    assert "epochs = 1" in " ".join(err.value.reasons)
    with pytest.raises(ConfigurationError):
        load_config(overrides={"pi_old": "mu"})


def test_steps_refuse_batches_without_pi_old():
    model = tiny_policy(seed=1)
    config = _config("recompute")
    *_, batches = pack_cycle(_trajectories(model), config, pad_id=2)
    with pytest.raises(ValueError, match="old_logprobs not filled"):
        train_steps(model, batches, config, make_optimizer(model, config))

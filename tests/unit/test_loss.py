"""Loss math against hand-computed cases (trainer/loss.py)."""

from __future__ import annotations

import math

import pytest
import torch

from trainer.loss import LossInputs, compute_advantages, kl_estimate, policy_loss


def _inputs(logp, old, behaviour, adv, mask=None, ref=None):
    t = lambda x: torch.tensor(x, dtype=torch.float32)  # noqa: E731
    lp = t(logp).requires_grad_()
    return lp, LossInputs(
        logprobs=lp,
        old_logprobs=t(old),
        behaviour_logprobs=t(behaviour),
        advantages=t(adv),
        loss_mask=t(mask if mask is not None else [1.0] * len(logp)),
        ref_logprobs=None if ref is None else t(ref),
    )


def test_advantages_are_reward_minus_group_mean_without_std():
    rewards = torch.tensor([1.0, 0.0, 3.0, 0.5, 2.0])
    groups = torch.tensor([7, 7, 7, 1, 2])
    adv = compute_advantages(rewards, groups, singleton_baseline="zero")
    # group 7: mean 4/3, no division by its std (1.247...)
    torch.testing.assert_close(adv, torch.tensor([1 - 4 / 3, -4 / 3, 3 - 4 / 3, 0.0, 0.0]))
    adv = compute_advantages(rewards, groups, singleton_baseline="batch_mean")
    torch.testing.assert_close(adv[3:], torch.tensor([0.5 - 1.3, 2.0 - 1.3]))
    with pytest.raises(ValueError):
        compute_advantages(torch.tensor([float("nan")]), torch.tensor([0]))


def test_on_policy_loss_is_reinforce_with_constant_normalizer():
    # pi_theta = pi_old = mu: ratio 1, weight 1, so loss = -sum(A) / Z and dL/dlogp_t = -A_t / Z.
    lp, inp = _inputs([-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [-1.0, -2.0, -0.5], [0.5, 0.5, -1.0])
    out = policy_loss(inp, normalizer=10.0)
    assert out.loss.item() == pytest.approx(-(0.5 + 0.5 - 1.0) / 10.0)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-0.05, -0.05, 0.1]))
    assert out.tokens.item() == 3 and out.is_clipped.item() == 0 and out.ppo_clipped.item() == 0


def test_normalizer_is_constant_not_token_count():
    # Extra tokens with zero advantage change nothing: no per-sequence length normalization.
    _, short = _inputs([-1.0], [-1.0], [-1.0], [1.0])
    _, long = _inputs([-1.0, -3.0, -2.0], [-1.0, -3.0, -2.0], [-1.0, -3.0, -2.0], [1.0, 0.0, 0.0])
    assert policy_loss(short, normalizer=4.0).loss.item() == pytest.approx(
        policy_loss(long, normalizer=4.0).loss.item()
    )


def test_importance_weight_is_truncated_at_cap():
    # pi_old / mu = 3 > cap 2 -> weight 2; pi_old / mu = 1.5 -> 1.5.
    lp, inp = _inputs([-1.0, -1.0], [-1.0, -1.0], [-1.0 - math.log(3.0), -1.0 - math.log(1.5)], [1.0, 1.0])
    out = policy_loss(inp, normalizer=1.0, is_cap=2.0)
    assert out.loss.item() == pytest.approx(-(2.0 + 1.5))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0, -1.5]))
    assert out.is_clipped.item() == 1
    assert out.is_weight_sum.item() == pytest.approx(3.5)
    # KL(mu || pi_old) by k3 with r = pi_old/mu: (r - 1) - log r
    expected = (3 - 1 - math.log(3)) + (1.5 - 1 - math.log(1.5))
    assert out.mismatch_kl_sum.item() == pytest.approx(expected, rel=1e-5)


def test_behaviour_as_pi_old_truncates_the_ratio_weight_inside_the_clip():
    # pi_old = mu: w = 1, r = pi_theta / mu, s = min(1, C / sg(r)); dL/dlogp = -min(r, C) A on the
    # unclipped branch, 0 on the clipped one (module docstring).
    mu = [-2.0] * 5
    d = [math.log(5.0), math.log(1.1), math.log(1.5), math.log(0.5), 100.0]  # log r
    adv = [-1.0, 1.0, 1.0, -1.0, -1.0]
    lp, inp = _inputs([m + x for m, x in zip(mu, d)], mu, mu, adv)
    out = policy_loss(inp, normalizer=1.0, is_cap=2.0, ratio_cap=2.0)
    # r=5, A<0: unclipped, value C A; r=1.1, A>0: unclipped; r=1.5, A>0 and r=0.5, A<0: clipped;
    # r=e^100, A<0: value C A, gradient C A, finite
    expected = [2.0, -1.1, -1.2, 0.8, 2.0]
    assert out.loss.item() == pytest.approx(sum(expected), rel=1e-5)
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([2.0, -1.1, 0.0, 0.0, 2.0]))
    assert out.is_clipped.item() == 2 and out.ppo_clipped.item() == 2
    assert out.mismatch_kl_sum.item() == 0.0  # pi_old is mu
    # KL(mu || pi_theta) by k3 with r = pi_theta / mu: (r - 1) - log r (e^100 overflows fp32: a metric only)
    _, first4 = _inputs([m + x for m, x in zip(mu[:4], d[:4])], mu[:4], mu[:4], adv[:4])
    r = [5.0, 1.1, 1.5, 0.5]
    kl = policy_loss(first4, normalizer=1.0, ratio_cap=2.0).behaviour_kl_sum.item()
    assert kl == pytest.approx(sum(x - 1 - math.log(x) for x in r), rel=1e-5)
    # without the ratio cap, the first token's weight would be r = 5
    lp2, inp2 = _inputs([m + x for m, x in zip(mu[:1], d[:1])], mu[:1], mu[:1], adv[:1])
    policy_loss(inp2, normalizer=1.0, is_cap=2.0).loss.backward()
    torch.testing.assert_close(lp2.grad, torch.tensor([5.0]))


def test_ppo_clip_against_cycle_start_policy():
    # ratio 1.5 with eps 0.2: positive advantage is clipped at 1.2 (zero gradient);
    # negative advantage keeps the unclipped (pessimistic) branch -1.5 A.
    r = math.log(1.5)
    lp, inp = _inputs([r, r], [0.0, 0.0], [0.0, 0.0], [1.0, -1.0])
    out = policy_loss(inp, normalizer=1.0, clip_eps_low=0.2, clip_eps_high=0.2)
    assert out.loss.item() == pytest.approx(-(1.2 * 1.0) - (1.5 * -1.0))
    out.loss.backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 1.5]))
    assert out.ppo_clipped.item() == 1
    assert out.ratio_sum.item() == pytest.approx(3.0)


def test_clip_higher_is_asymmetric():
    r = math.log(1.25)
    lp, inp = _inputs([r], [0.0], [0.0], [1.0])
    out = policy_loss(inp, normalizer=1.0, clip_eps_low=0.2, clip_eps_high=0.28)
    assert out.loss.item() == pytest.approx(-1.25) and out.ppo_clipped.item() == 0


def test_kl_estimators_hand_computed():
    # pi = 0.5, pi_ref = 0.25: r = 2; k1 = -log 2, k3 = (2 - 1) - log 2
    logp, ref = torch.log(torch.tensor([0.5])), torch.log(torch.tensor([0.25]))
    assert kl_estimate(logp, ref, "k1").item() == pytest.approx(-math.log(2))
    assert kl_estimate(logp, ref, "k3").item() == pytest.approx(1 - math.log(2))
    with pytest.raises(ValueError):
        kl_estimate(logp, ref, "k2")


def test_kl_estimators_are_unbiased_for_kl_of_the_sampler_to_the_policy():
    """Tokens drawn from pi_ref (the sampler: mu, or pi_old): both estimators average to the exact
    KL(pi_ref || pi); on a token the update made 1e-6 times as likely, k3 stays near -log r (~14
    nats) where the other orientation's exp(log pi_ref - log pi) would be 10^6."""
    g = torch.Generator().manual_seed(0)
    ref_p = torch.tensor([0.6, 0.3, 0.1])
    pi_p = torch.tensor([0.2, 0.5, 0.3])
    exact = float((ref_p * (ref_p.log() - pi_p.log())).sum())
    x = torch.multinomial(ref_p, 400_000, replacement=True, generator=g)
    logp, ref = pi_p.log()[x], ref_p.log()[x]
    assert kl_estimate(logp, ref, "k3").mean().item() == pytest.approx(exact, rel=0.02)
    assert kl_estimate(logp, ref, "k1").mean().item() == pytest.approx(exact, rel=0.02)
    suppressed = kl_estimate(torch.tensor([math.log(1e-6)]), torch.tensor([0.0]), "k3").item()
    assert suppressed == pytest.approx(-1 + 1e-6 + 6 * math.log(10)) and suppressed < 15


def test_kl_penalty_adds_beta_times_estimate():
    lp, inp = _inputs([math.log(0.5)], [math.log(0.5)], [math.log(0.5)], [0.0], ref=[math.log(0.25)])
    out = policy_loss(inp, normalizer=2.0, kl_coef=0.1, kl_estimator="k3")
    assert out.loss.item() == pytest.approx(0.1 * (1 - math.log(2)) / 2.0, rel=1e-5)
    out.loss.backward()
    # d k3 / d logp = r - 1 with r = 0.5 / 0.25
    assert lp.grad.item() == pytest.approx(0.1 * 1.0 / 2.0, rel=1e-5)
    _, no_ref = _inputs([0.0], [0.0], [0.0], [0.0])
    with pytest.raises(ValueError):
        policy_loss(no_ref, normalizer=1.0, kl_coef=0.1)


def test_masked_tokens_contribute_nothing_even_with_garbage():
    lp, inp = _inputs([-1.0, -1.0], [-1.0, 50.0], [-1.0, -100.0], [1.0, 5.0], mask=[1.0, 0.0])
    out = policy_loss(inp, normalizer=1.0)
    out.loss.backward()
    assert out.loss.item() == pytest.approx(-1.0)
    assert torch.isfinite(lp.grad).all() and lp.grad[1].item() == 0.0
    assert out.tokens.item() == 1 and out.is_clipped.item() == 0

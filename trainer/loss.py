"""The off-policy policy-gradient loss of the continual trainer, as pure functions.

Invariant: this module imports only torch; no database, broker or config loader. Every function
maps tensors to tensors, so the math is testable against hand-computed cases.

Three policies meet in one token's loss:

* ``mu`` -- the behaviour policy: the serving checkpoint that sampled the token, with the serving
  engine's numerics. Its log-prob was recorded at serving time (``model.responded``).
* ``pi_old`` -- the trainer's policy at the start of the cycle (the parent checkpoint, recomputed
  by the trainer before the first update), or ``mu`` itself when a batch is used once (below).
* ``pi_theta`` -- the policy being optimized.

Per token ``t`` of a trajectory with advantage ``A``:

    w_t   = min(pi_old(t) / mu(t), C)                       (truncated importance weight, no grad)
    r_t   = pi_theta(t) / pi_old(t)
    L_t   = -w_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t
    loss  = sum_t mask_t L_t / Z                             (Z a constant, not the token count)

* Advantages: ``A = R - mean(R over the trajectory's group)`` with no division by the group's
  standard deviation, and a constant normalizer ``Z`` -- Dr. GRPO (Liu et al. 2025, "Understanding
  R1-Zero-Like Training: A Critical Perspective", arXiv:2503.20783), which shows that the std and
  per-sequence length normalizations of GRPO (Shao et al. 2024) bias optimization towards easy
  groups and long wrong answers.
* ``w_t``: the decoupled off-policy correction. Data was sampled by ``mu`` (an older checkpoint,
  and a different inference stack), so the surrogate is reweighted by ``pi_old / mu``, truncated at
  ``C`` (default 2) to bound the variance -- IMPALA's truncated importance weights (Espeholt et al.
  2018, "IMPALA", V-trace ``rho_bar``), applied per token to the rollout/trainer mismatch as in Yao
  et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS). The
  split into ``w_t`` and a PPO ratio against ``pi_old`` is the decoupled PPO objective of Hilton et
  al. 2022 ("Batch size-invariance for policy optimization").
* ``r_t`` with clipping: PPO's clipped surrogate (Schulman et al. 2017, eq. 7) against the policy
  at the start of the cycle, so several optimizer steps on one cycle's data stay in a trust region;
  ``eps_high > eps_low`` gives DAPO's clip-higher (Yu et al. 2025).
* ``pi_old = mu`` (``pi_old = "behaviour"``, one optimizer step per micro-batch): the recompute
  pass is skipped, ``w_t = 1`` and the ratio ``r_t = pi_theta / mu`` carries the serving/trainer
  mismatch, so its weight is truncated instead (``ratio_cap = C``)::

      s_t = min(1, C / sg(r_t))                                (no grad)
      L_t = -s_t * min(r_t A, clip(r_t, 1 - eps_low, 1 + eps_high) A) + beta * KL_t

  A token on the unclipped branch gets the gradient ``-min(r_t, C) A grad log pi_theta``: Yao et
  al. 2025's truncated importance weight ``min(pi_trainer / pi_sampler, C)`` on the policy
  gradient, taken over the whole ratio, inside PPO's clip against the sampler (PPO's own setting,
  where the sampling policy is pi_old; prime-rl also takes its ratio against the inference
  engine's log-probs). At the first step (``pi_theta`` = parent) this is the recompute gradient
  ``-min(pi_old / mu, C) A grad log pi`` except on tokens whose mismatch alone puts ``r_t``
  outside the clip range on the side their advantage pushes: those get none. With ``mu`` equal
  to the trainer's own log-probs both modes give the same loss and gradients (tests check it).
* ``KL_t`` (optional, ``beta = 0`` by default): the k1 (``log pi_ref - log pi_theta``) or k3
  (``(r - 1) - log r`` with ``r = pi_theta / pi_ref``) estimator of ``KL(pi_ref || pi_theta)``
  from Schulman 2020, "Approximating KL Divergence" (blog), for tokens drawn from ``pi_ref``: here
  the reference is pi_old, and the tokens were sampled by mu, which is pi_old or close to it. The
  other orientation (``exp(log pi_ref - log pi_theta) - ...``, DeepSeekMath's, for tokens drawn
  from pi_theta) weighs each sampled token by ``pi_ref / pi_theta``: on tokens an update has made
  unlikely it grows without bound, so a few tokens can make a mean of 10^5 nats/token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

KLEstimator = Literal["k1", "k3"]


def compute_advantages(
    rewards: Tensor, group_ids: Tensor, *, singleton_baseline: Literal["zero", "batch_mean"] = "batch_mean"
) -> Tensor:
    """Advantage of each trajectory: its reward minus its group's mean reward (no std scaling).

    Dr. GRPO (Liu et al. 2025, eq. 4 without the ``1/std`` factor). A group of one has no peers: its
    advantage is 0 under ``zero``, or its reward minus the mean reward of the whole batch under
    ``batch_mean`` (a plain REINFORCE baseline, Williams 1992), so product sessions on unique tasks
    still carry signal.

    Args:
        rewards: ``[G]`` float, one reward per trajectory.
        group_ids: ``[G]`` int64; equal ids share a task (one group).
        singleton_baseline: what a trajectory alone in its group is compared with.

    Returns:
        ``[G]`` float32 advantages.

    Raises:
        ValueError: shapes differ or rewards are not finite.
    """
    if rewards.shape != group_ids.shape or rewards.dim() != 1:
        raise ValueError(f"rewards {tuple(rewards.shape)} and group_ids {tuple(group_ids.shape)} must be equal 1-D")
    if not torch.isfinite(rewards).all():
        raise ValueError("rewards must be finite")
    rewards = rewards.float()
    if rewards.numel() == 0:
        return rewards
    _, inverse = torch.unique(group_ids, return_inverse=True)
    n_groups = int(inverse.max()) + 1
    sums = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, inverse, rewards)
    counts = torch.zeros(n_groups, dtype=torch.float32).index_add_(0, inverse, torch.ones_like(rewards))
    baseline = (sums / counts)[inverse]
    alone = counts[inverse] == 1
    if singleton_baseline == "batch_mean":
        baseline = torch.where(alone, rewards.mean(), baseline)
    elif singleton_baseline != "zero":
        raise ValueError(f"unknown singleton_baseline {singleton_baseline!r}")
    return rewards - baseline


@dataclass(frozen=True)
class LossInputs:
    """Per-token tensors of one micro-batch. All share one shape ``S`` (e.g. ``[N]`` trainable
    tokens, or ``[B, T]``); log-probs are natural-log, fp32.

    Attributes:
        logprobs: ``S`` log pi_theta(token | prefix), differentiable.
        old_logprobs: ``S`` log pi_old, the policy at the start of the cycle (no grad).
        behaviour_logprobs: ``S`` log mu, recorded by the serving engine (no grad).
        advantages: ``S`` the token's trajectory advantage (broadcast over its tokens).
        loss_mask: ``S`` bool or {0, 1}: 1 on the model's own (sampled) tokens.
        ref_logprobs: ``S`` log pi_ref for the KL penalty, or None.
    """

    logprobs: Tensor
    old_logprobs: Tensor
    behaviour_logprobs: Tensor
    advantages: Tensor
    loss_mask: Tensor
    ref_logprobs: Tensor | None = None


@dataclass(frozen=True)
class LossOutputs:
    """The loss to backpropagate and per-micro-batch sums for metrics (divide by ``tokens``).

    Attributes:
        loss: ``[]`` scalar, ``sum(mask * L_t) / normalizer``.
        tokens: ``[]`` number of masked tokens.
        pg_loss_sum: ``[]`` sum of the policy-gradient terms (before normalization).
        kl_sum: ``[]`` sum of the KL estimator to the reference (0 when none).
        is_clipped: ``[]`` count of tokens whose importance weight was truncated (``pi_old / mu``
            above ``is_cap``, or ``pi_theta / mu`` above ``ratio_cap``).
        ppo_clipped: ``[]`` count of tokens where the clipped branch of the surrogate was taken.
        ratio_sum: ``[]`` sum of ``pi_theta / pi_old``.
        is_weight_sum: ``[]`` sum of the truncated weights ``w_t`` (times ``s_t`` with ``ratio_cap``).
        mismatch_kl_sum: ``[]`` sum of k3 estimates of ``KL(mu || pi_old)`` (serving/trainer drift;
            0 when pi_old is mu).
        behaviour_kl_sum: ``[]`` sum of k3 estimates of ``KL(mu || pi_theta)``: the mismatch plus
            the cycle's updates so far.
    """

    loss: Tensor
    tokens: Tensor
    pg_loss_sum: Tensor
    kl_sum: Tensor
    is_clipped: Tensor
    ppo_clipped: Tensor
    ratio_sum: Tensor
    is_weight_sum: Tensor
    mismatch_kl_sum: Tensor
    behaviour_kl_sum: Tensor


def kl_estimate(logprobs: Tensor, ref_logprobs: Tensor, estimator: KLEstimator = "k3") -> Tensor:
    """Per-token estimate of ``KL(pi_ref || pi)`` from tokens sampled by ``pi_ref`` (Schulman 2020,
    "Approximating KL Divergence": for ``x ~ q`` and ``r = p(x) / q(x)``, ``KL(q || p)`` is the mean of
    ``k1 = -log r`` or ``k3 = (r - 1) - log r``; here ``q = pi_ref``, ``p = pi``).

    ``k1 = log pi_ref - log pi`` (unbiased, high variance, can be negative);
    ``k3 = (r - 1) - log r`` with ``r = pi / pi_ref`` (unbiased, lower variance, >= 0; it grows
    like ``-log r`` where an update made a sampled token unlikely, and like ``r`` only where it made
    one far likelier than the sampler did). As a penalty both have the gradient of ``KL(pi_ref || pi)``
    under tokens drawn from ``pi_ref``: ``(r - 1) grad log pi`` (k3), ``-grad log pi`` (k1).

    Args:
        logprobs, ref_logprobs: same shape ``S``, natural log.

    Returns:
        ``S`` per-token estimates (nats).

    Raises:
        ValueError: an unknown estimator.
    """
    log_r = logprobs - ref_logprobs
    if estimator == "k1":
        return -log_r
    if estimator == "k3":
        return torch.expm1(log_r) - log_r
    raise ValueError(f"unknown KL estimator {estimator!r}")


def policy_loss(
    inputs: LossInputs,
    *,
    normalizer: float,
    is_cap: float = 2.0,
    clip_eps_low: float = 0.2,
    clip_eps_high: float = 0.2,
    kl_coef: float = 0.0,
    kl_estimator: KLEstimator = "k3",
    ratio_cap: float | None = None,
) -> LossOutputs:
    """The truncated-importance-weighted, PPO-clipped policy-gradient loss (see the module docstring).

    Args:
        inputs: per-token tensors of one micro-batch.
        normalizer: the constant ``Z`` (tokens); the same for every micro-batch of a step so that
            gradient accumulation sums to one step's loss (Dr. GRPO).
        is_cap: ``C``, the truncation of ``pi_old / mu`` (IMPALA's ``rho_bar``); ``inf`` disables it.
        clip_eps_low, clip_eps_high: PPO clip range ``[1 - eps_low, 1 + eps_high]``.
        kl_coef: ``beta``; requires ``inputs.ref_logprobs`` when positive.
        kl_estimator: ``k1`` or ``k3``.
        ratio_cap: ``C`` of the ratio's weight ``s_t`` when ``old_logprobs`` are the behaviour
            log-probs (module docstring); None: no ``s_t``.

    Returns:
        :class:`LossOutputs`; ``loss`` is differentiable through ``inputs.logprobs`` only.

    Raises:
        ValueError: non-positive normalizer or cap, or a KL coefficient without reference log-probs.
    """
    if normalizer <= 0 or is_cap <= 0 or (ratio_cap is not None and ratio_cap <= 0):
        raise ValueError("normalizer, is_cap and ratio_cap must be positive")
    if kl_coef > 0 and inputs.ref_logprobs is None:
        raise ValueError("kl_coef > 0 needs ref_logprobs")
    mask = inputs.loss_mask.bool()
    logp = inputs.logprobs
    old = inputs.old_logprobs.detach()
    # Unmasked positions (prompt, tool output) carry no behaviour log-prob: neutralize them so
    # nothing there can overflow into a NaN gradient.
    behaviour = torch.where(mask, inputs.behaviour_logprobs.detach(), old)
    adv = inputs.advantages.detach().to(logp.dtype)

    def masked_sum(x: Tensor) -> Tensor:
        return torch.where(mask, x, torch.zeros_like(x)).sum()

    log_is = old - behaviour
    raw_is = torch.exp(log_is)
    is_weight = torch.clamp(raw_is, max=is_cap)
    truncated = raw_is > is_cap
    log_ratio = logp - old
    ratio = torch.exp(log_ratio)
    # clipped in log space: outside the range its gradient is 0 times a finite exp, never 0 * inf
    clipped_ratio = torch.exp(torch.clamp(log_ratio, math.log1p(-clip_eps_low), math.log1p(clip_eps_high)))
    shrink = torch.ones_like(ratio)
    if ratio_cap is None:
        surrogate = torch.minimum(ratio * adv, clipped_ratio * adv)
    else:  # s_t = min(1, C / sg(r_t)) applied in log space: a huge r_t never meets s_t = 0 as inf * 0
        log_shrink = torch.clamp(log_ratio.detach() - math.log(ratio_cap), min=0.0)
        shrink = torch.exp(-log_shrink)
        surrogate = torch.minimum(torch.exp(log_ratio - log_shrink) * adv, clipped_ratio * shrink * adv)
        truncated = truncated | (log_shrink > 0)
    pg = -is_weight * surrogate
    per_token = pg
    kl = torch.zeros_like(logp)
    if inputs.ref_logprobs is not None:
        kl = kl_estimate(logp, inputs.ref_logprobs.detach(), kl_estimator)
        if kl_coef > 0:
            per_token = per_token + kl_coef * kl
    loss = masked_sum(per_token) / normalizer

    with torch.no_grad():
        took_clip = ((adv > 0) & (ratio > 1.0 + clip_eps_high)) | ((adv < 0) & (ratio < 1.0 - clip_eps_low))
        return LossOutputs(
            loss=loss,
            tokens=mask.sum().to(torch.float32),
            pg_loss_sum=masked_sum(pg.detach()),
            kl_sum=masked_sum(kl.detach()),
            is_clipped=masked_sum(truncated.float()),
            ppo_clipped=masked_sum(took_clip.float()),
            ratio_sum=masked_sum(ratio.detach()),
            is_weight_sum=masked_sum(is_weight * shrink),
            mismatch_kl_sum=masked_sum(kl_estimate(old, behaviour)),
            behaviour_kl_sum=masked_sum(kl_estimate(logp.detach(), behaviour)),
        )

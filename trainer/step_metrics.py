"""What one optimizer step reports (:class:`StepMetrics`) and the update watch that reads it.

Invariant: every mean is token-weighted over the step's trainable tokens (summed over micro-batches
and, data-parallel, over ranks, then divided once), so a metric does not depend on how the step
was split into micro-batches.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from trainer.config import TrainerConfig

LOSS_SUMS = (
    "pg_loss_sum",
    "kl_sum",
    "mismatch_kl_sum",
    "behaviour_kl_sum",
    "is_clipped",
    "ppo_clipped",
    "ratio_sum",
)  # the LossOutputs fields a micro-batch adds up
STEP_SUMS = LOSS_SUMS + ("entropy_sum", "adv", "advabs")
# what a step adds up over its micro-batches (and, data-parallel, over ranks)


@dataclass
class StepMetrics:
    """Metrics of one optimizer step (token-weighted means over its micro-batches)."""

    step: int
    loss: float = 0.0
    pg_loss: float = 0.0
    kl: float = 0.0
    """``KL(pi_old || pi_theta)`` at this step's forward (nats/token; ``loss.kl_estimator``, from the
    sampled tokens, :func:`trainer.loss.kl_estimate`): the cycle's updates so far, what
    ``max_kl_per_token`` watches. Equal to ``behaviour_kl`` when pi_old is mu."""
    mismatch_kl: float = 0.0
    """k3 ``KL(mu || pi_old)`` (nats/token): the serving/trainer mismatch; 0 when pi_old is mu."""
    behaviour_kl: float = 0.0
    """k3 ``KL(mu || pi_theta)`` at this step's forward (nats/token): the mismatch plus the updates so far."""
    is_clip_frac: float = 0.0
    ppo_clip_frac: float = 0.0
    ratio: float = 0.0
    entropy: float = 0.0
    advantage_mean: float = 0.0
    advantage_abs: float = 0.0
    grad_norm: float = 0.0
    lr: float = 0.0
    trainable_tokens: int = 0
    tokens: int = 0
    """real tokens of the step's rows (a shared prefix counted in each row that continues it)"""
    computed_tokens: int = 0
    """real tokens the forward passes computed (a shared prefix once per micro-batch)"""
    seconds: float = 0.0
    tokens_per_s: float = 0.0
    """``tokens / seconds``: rows' tokens trained per second"""
    skipped_micro_batches: int = 0
    """micro-batches whose loss was not finite (NaN/Inf): left out of the step, never backpropagated."""
    skipped_step: bool = False
    """the optimizer step was not taken: every micro-batch skipped, a non-finite gradient norm, or
    the update watch stopped the cycle here."""
    stopped_early: str | None = None
    """why the update watch stopped the cycle at this step (``max_kl_per_token``, ``min_entropy``); None: it did not."""
    extra: dict[str, float] = field(default_factory=dict)


def update_watch(m: StepMetrics, config: TrainerConfig) -> str | None:
    """Why the cycle stops at step ``m`` (its KL to pi_old above ``max_kl_per_token``, or its entropy
    below ``min_entropy``; a KL that is not finite counts as above), or None to go on. The step's
    forward pass measures the updates of the steps before it."""
    if config.max_kl_per_token is not None and not m.kl <= config.max_kl_per_token:
        return f"kl to pi_old {m.kl:.4g} nats/token > max_kl_per_token {config.max_kl_per_token:g}"
    if config.min_entropy is not None and not m.entropy >= config.min_entropy:
        return f"entropy {m.entropy:.4g} nats/token < min_entropy {config.min_entropy:g}"
    return None


def fill_means(m: StepMetrics, sums: dict[str, float]) -> None:
    """Set ``m``'s per-token means from the step's sums (:data:`STEP_SUMS`) over its
    ``trainable_tokens``; an empty ``sums`` (every micro-batch skipped) gives zeros."""
    n = max(m.trainable_tokens, 1)
    s = defaultdict(float, sums)
    m.pg_loss, m.kl, m.mismatch_kl = s["pg_loss_sum"] / n, s["kl_sum"] / n, s["mismatch_kl_sum"] / n
    m.behaviour_kl = s["behaviour_kl_sum"] / n
    m.is_clip_frac, m.ppo_clip_frac = s["is_clipped"] / n, s["ppo_clipped"] / n
    m.ratio, m.entropy = s["ratio_sum"] / n, s["entropy_sum"] / n
    m.advantage_mean, m.advantage_abs = s["adv"] / n, s["advabs"] / n

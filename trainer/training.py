"""Training the policy on a cycle's trajectories: the part every data-parallel rank runs.

:func:`pack_cycle` turns trajectories into rewards, Dr. GRPO advantages over task groups
(:mod:`trainer.loss`) and padded micro-batches (:mod:`trainer.batching`); :func:`train_policy` loads the
parent policy on ``config.device`` in ``config.precision``, computes pi_old (or takes the behaviour
log-probs as pi_old) and runs the optimizer steps (:mod:`trainer.step`), on every weight or, with
``lora.rank > 0``, on low-rank adapters merged into the weights afterwards (:mod:`trainer.lora`).
:func:`trainer.cycle.run_cycle` calls them on rank 0, the other ranks of a ``torchrun`` group through
:func:`trainer.cycle.run_parallel_cycle`, all on the trajectories rank 0 claimed.

Invariant: a cycle claims only what it trains. :func:`fit_claim_to_budget` runs on rank 0 before any
rank trains: it shrinks the claim to the step budget (``max_steps``; whole task groups, newest first,
are deferred to the next cycle), never the schedule, so every claimed trajectory has tokens in the
micro-batches every epoch trains, and advantages are computed over exactly those trajectories.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from app.core.telemetry import tracer
from trainer.batching import group_ids, pack_micro_batches
from trainer.checkpointing import load_policy
from trainer.config import TrainerConfig
from trainer.device import Placement, setup_placement
from trainer.distributed import DataParallel
from trainer.lora import attach_adapters, merge_adapters
from trainer.loss import compute_advantages
from trainer.metrics import step_progress
from trainer.router_replay import checkpoint_contexts
from trainer.sharding import ShardedDataParallel
from trainer.step import (
    compute_old_logprobs,
    make_optimizer,
    micro_batch_schedule,
    planned_steps,
    train_steps,
    use_behaviour_logprobs,
)
from trainer.step_metrics import StepMetrics

_tracer = tracer("flywheel.trainer")
_LIBC = ctypes.CDLL(ctypes.util.find_library("c") or None)


def trim_heap() -> None:
    """Hand the heap's freed pages back to the OS (glibc ``malloc_trim(0)``; a no-op on other C
    libraries). Between optimizer steps almost all of a CPU trainer's resident memory above its live
    weights, gradients and AdamW state is activations already freed but kept by the allocator, and
    it grows step by step (docs/trainer.md, "Where the trainer's memory goes")."""
    trim = getattr(_LIBC, "malloc_trim", None)
    if trim is not None:
        trim(0)


MAX_SPAN_IDS = 256  # trajectory ids put on the span (the manifest has them all)


def placebo_permutation(trajectory_ids: list, seed: int, groups: list | None = None) -> np.ndarray:
    """The placebo's permutation of one cycle: ``[G]`` int64 indices, seeded by ``seed`` and the
    cycle's trajectory ids (sorted), so each cycle draws its own and a rerun the same.

    With ``groups`` (one key per trajectory, e.g. its task id), the permutation stays within each group:
    a trajectory takes the reward of another of its own group, so each group keeps its multiset of
    rewards (its mean and spread) and only which of its trajectories holds which reward is random
    (``data.placebo_mode = "within_group"``). Without, one permutation across the whole cycle
    (``"across_cycle"``, as before 2026-12-02: the seed depends on the ids, not their order).
    """
    digest = hashlib.sha256("\n".join(sorted(str(i) for i in trajectory_ids)).encode()).digest()
    rng = np.random.default_rng([seed, int.from_bytes(digest[:8], "little")])
    if groups is None:
        return rng.permutation(len(trajectory_ids))
    members: dict[str, list[int]] = {}
    for i, key in enumerate(groups):
        members.setdefault(str(key), []).append(i)
    out = np.arange(len(trajectory_ids))
    for key in sorted(members):
        rows = sorted(members[key], key=lambda i: str(trajectory_ids[i]))
        out[rows] = np.asarray(rows)[rng.permutation(len(rows))]
    return out


def pack_cycle(trajectories: list, config: TrainerConfig, pad_id: int = 0):
    """Rewards, task groups, advantages and micro-batches of ``trajectories`` (rewards negated with
    ``invert_reward``; with ``data.placebo`` shuffled by :func:`placebo_permutation` before the
    advantages, within each task group by default (``data.placebo_mode``), so the cycle trains on
    rewards that say nothing about its own trajectories with its groups' advantages as large as the
    real run's: Shao et al. 2025, "Spurious Rewards").

    Returns:
        ``(rewards [G] fp32, groups [G] int64, advantages [G] fp32, micro-batches)`` for ``G``
        trajectories; ``rewards`` are the ones trained on (shuffled under the placebo).
    """
    groups = group_ids(trajectories)
    rewards = torch.tensor([t.reward for t in trajectories], dtype=torch.float32)
    if config.invert_reward:
        rewards = -rewards
    if config.data.placebo:
        within = [t.group for t in trajectories] if config.data.placebo_mode == "within_group" else None
        rewards = rewards[torch.from_numpy(placebo_permutation([t.id for t in trajectories], config.seed, within))]
    advantages = compute_advantages(rewards, groups, singleton_baseline=config.data.singleton_baseline)
    batches = pack_micro_batches(
        trajectories,
        advantages,
        micro_batch_tokens=config.data.micro_batch_tokens,
        pad_id=pad_id,
        seed=config.seed,
        share_prefixes=config.data.share_prefixes and not config.gradient_checkpointing,
    )
    return rewards, groups, advantages, batches


def fit_claim_to_budget(data, config: TrainerConfig) -> int:
    """Shrink the cycle's claim to its step budget; return how many micro-batches it packs into.

    While ``planned_steps > config.max_steps``, the newest task group is deferred (the last
    trajectories one by one once a single group is left), so advantages are computed over exactly
    the trajectories that train.

    Raises:
        AssertionError: a claimed trajectory has no trainable token (selection excludes those).
    """
    while True:
        *_, batches = pack_cycle(data.used, config)
        if config.max_steps is None or planned_steps(len(batches), config) <= config.max_steps or len(data.used) == 1:
            trained = {int(i) for b in batches for i in b.trajectory_index.unique().tolist()}
            if trained != set(range(len(data.used))):
                raise AssertionError(f"{len(data.used) - len(trained)} claimed trajectories have no trainable token")
            return len(batches)
        last = data.used[-1].group
        tail = [t.id for t in data.used if t.group == last]
        data.defer(set(tail) if len(tail) < len(data.used) else {tail[-1]})


def trained_trajectories(batches: list, config: TrainerConfig, history: list[StepMetrics]) -> set[int]:
    """Indices (into the cycle's trajectory list) of the trajectories with tokens in an optimizer step
    the cycle ran: all of them unless the update watch stopped it, else those of the steps before the
    stopped one (a step skipped for a non-finite loss counts as run: its data had its turn).

    ``batches`` and ``config`` must be those :func:`train_steps` ran, whose schedule
    (:func:`trainer.step.micro_batch_schedule`) is a function of them alone.
    """
    if not history or history[-1].stopped_early is None:
        return {int(i) for mb in batches for i in mb.trajectory_index.unique().tolist()}
    ran = list(micro_batch_schedule(batches, config))[: len(history) - 1]
    return {int(i) for group in ran for mb in group for i in mb.trajectory_index.unique().tolist()}


@dataclass
class TrainedPolicy:
    """What :func:`train_policy` returns: the trained model and what the checkpoint records of it."""

    model: torch.nn.Module | None  # None on the ranks other than 0 of a sharded (FSDP) group
    optimizer: torch.optim.Optimizer
    history: list[StepMetrics]
    mismatch: dict[str, float]  # KL(mu || pi_old) before any update, as compute_old_logprobs returns it
    rewards: torch.Tensor  # [G] fp32
    advantages: torch.Tensor  # [G] fp32
    groups: torch.Tensor  # [G] int64
    placement: Placement
    micro_batches: int = 0
    trained: set[int] | None = None  # indices of the trajectories an optimizer step ran on (trained_trajectories)


def train_policy(
    config: TrainerConfig,
    parent_dir: Path,
    trajectories: list,
    *,
    progress: bool = False,
    dp: DataParallel | None = None,
) -> TrainedPolicy:
    """Load the parent policy on ``config.device`` and run the cycle's optimizer steps on ``trajectories``.

    Every rank of ``dp`` calls this with the same arguments; rank 0 alone draws progress. With a sharded ``dp``
    (:class:`trainer.sharding.ShardedDataParallel`) the model is sharded before pi_old and the
    optimizer, and the trained weights are gathered back into a whole fp32 model on rank 0 (the
    returned ``model``; None on the other ranks).

    Raises:
        CheckpointError: ``parent_dir`` is not a model folder.
        ConfigurationError: ``config.device`` names a device this machine lacks.
    """
    main = dp is None or dp.is_main
    placement = setup_placement(config.device, precision=config.precision)
    with _tracer.start_as_current_span("trainer.load") as span:
        span.set_attributes({"flywheel.parent_dir": str(parent_dir), **placement.describe()})
        model = load_policy(parent_dir)
        torch.manual_seed(config.seed)  # the adapters' random initialisation (peft draws from torch's global RNG)
        adapters = attach_adapters(model, config.lora) if config.lora.rank else None
        if config.gradient_checkpointing:  # recomputed MoE layers keep their replayed routes
            model.gradient_checkpointing_enable(
                gradient_checkpointing_kwargs={"use_reentrant": False, "context_fn": checkpoint_contexts}
            )
        if dp is not None and isinstance(dp, ShardedDataParallel):
            dp.shard(model, placement)  # layer by layer from the CPU: the whole model never sits on the device
        else:
            placement.place_model(model)
    pad_id = model.config.pad_token_id if isinstance(model.config.pad_token_id, int) else 0
    rewards, groups, advantages, batches = pack_cycle(trajectories, config, pad_id)
    batches = [placement.move_batch(mb) for mb in batches]
    mismatch: dict[str, float] = {}
    if config.pi_old == "behaviour":
        use_behaviour_logprobs(batches)
    else:
        with _tracer.start_as_current_span("trainer.old_logprobs") as span:
            mismatch = compute_old_logprobs(model, batches, config, placement=placement, dp=dp)
            span.set_attributes({f"flywheel.{k}": v for k, v in mismatch.items()})
    trim_heap()  # the load's and the pi_old pass's freed memory
    optimizer = make_optimizer(model, config)
    total_steps = planned_steps(len(batches), config)
    with (
        _tracer.start_as_current_span("trainer.train") as span,
        step_progress(total_steps, progress and main) as advance,
    ):
        span.set_attribute("flywheel.trajectory_ids", [str(t.id) for t in trajectories[:MAX_SPAN_IDS]])

        def on_step(m) -> None:
            trim_heap()
            advance(m)
            span.add_event(
                "step",
                {
                    "step": m.step,
                    "loss": m.loss,
                    "kl": m.kl,
                    "behaviour_kl": m.behaviour_kl,
                    "entropy": m.entropy,
                    "is_clip_frac": m.is_clip_frac,
                    "tokens_per_s": m.tokens_per_s,
                    **({"stopped_early": m.stopped_early} if m.stopped_early else {}),
                },
            )

        history = train_steps(model, batches, config, optimizer, on_step=on_step, placement=placement, dp=dp)
    if adapters is not None:
        with _tracer.start_as_current_span("trainer.merge_adapters"):
            model = merge_adapters(adapters)
    trained_model: torch.nn.Module | None = model
    if dp is not None and isinstance(dp, ShardedDataParallel):
        with _tracer.start_as_current_span("trainer.gather_weights"):
            trained_model = dp.full_model(model)  # rank 0: the unsharded fp32 policy to publish; the others: None
    if config.pi_old == "behaviour" and history:  # step 1's forward ran at the parent: its KL(mu || pi_theta)
        first = history[0]
        mismatch = {
            "mismatch_kl": first.behaviour_kl,
            "mismatch_is_clip_frac": first.is_clip_frac,
            "old_entropy": first.entropy,
        }
    return TrainedPolicy(
        model=trained_model,
        optimizer=optimizer,
        history=history,
        mismatch=mismatch,
        rewards=rewards,
        advantages=advantages,
        groups=groups,
        placement=placement,
        micro_batches=len(batches),
        trained=trained_trajectories(batches, config, history),
    )

"""The RL step: one cycle's optimizer steps on production trajectories, readable on one screen.

Textbook GRPO (Shao et al. 2024, DeepSeekMath) samples G completions per prompt from the current
policy, normalizes rewards by the group's mean and std, averages the clipped surrogate per
sequence, and adds a KL penalty to a frozen reference. Our setting differs -- the data are
developers' sessions collected by *earlier* checkpoints over hours -- so this loop deviates
(after karpathy/nanochat ``scripts/chat_rl.py``, which lists its own deviations the same way):

1. **Off-policy data, not fresh samples.** Tokens were sampled by the serving checkpoint(s), up to
   ``max_staleness_generations`` behind, through a different inference stack. Each token's loss is
   reweighted by ``min(pi_old / mu, C)`` with ``mu`` the behaviour log-prob recorded at serving
   time (truncated importance sampling: IMPALA; Yao et al. 2025).
2. **pi_old is recomputed, or is mu** (``pi_old``). ``recompute``: before the first update the
   trainer scores every trainable token under the parent checkpoint (``compute_old_logprobs``), so
   the PPO ratio and its clip are against the policy at the start of the cycle; that pass also
   measures the serving/trainer mismatch ``KL(mu || pi_old)``. ``behaviour`` (``epochs = 1`` only,
   each micro-batch in one step): no such pass; pi_old is mu, the ratio ``pi_theta / mu`` has its
   weight truncated at ``is_cap`` (``trainer/loss.py``), and the mismatch is step 1's
   ``behaviour_kl``, ``KL(mu || pi_theta)`` before any update.
3. **Groups are tasks, and may be singletons.** A group is every trajectory on one task; a task seen
   once is compared with the batch mean (REINFORCE baseline) instead of giving zero advantage.
4. **No std normalization, constant normalizer** (Dr. GRPO, Liu et al. 2025): loss sums over tokens
   and divides by a fixed token count, the same for every micro-batch and step.
5. **No KL to a frozen reference by default** (``kl_coef = 0``; the trust region is the clip and
   the gate). KL to the parent is always *reported*; ``kl_coef > 0`` adds it (k1 or k3).
6. **Multi-turn, tool-using trajectories.** Only the model's own tokens are trained (loss mask);
   prompts, tool outputs and the developer's text are context. A session split by
   self-summarization is several rows sharing one reward.
7. **Log-probs never materialize [tokens x vocab] logits**, and only trainable positions reach the
   LM head: their hidden states, divided by the serving temperature, go through
   :func:`kernels.logprob_loss.chunked_logprob_loss`, which forms each token chunk's gradients while
   its logits are in memory (Triton kernel with autograd on GPU).
8. **MoE router replay** (``router_replay``): the forward pass routes sampled tokens through the
   experts serving recorded, weights from the trainer's own router (R3, :mod:`trainer.router_replay`).
9. **An update-size watch beside the clip** (off by default). Each step's forward pass measures
   the mean KL to pi_old (with pi_old = mu it includes the serving mismatch) and the entropy; past
   ``max_kl_per_token`` (or under ``min_entropy``) that step takes no update and the cycle stops
   (``stopped_early``), so a runaway cycle cannot go on; its checkpoint still goes to the gate.
10. **bf16 compute over fp32 master weights** (``precision``, :mod:`trainer.device`): on CUDA and
    on CPUs with native bf16, forward passes run under autocast, the LM head included; AdamW
    keeps fp32 weights and state.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import Callable, Iterator

import torch
from transformers import DynamicCache

from kernels import chunked_logprobs
from kernels.logprob_loss import chunked_logprob_loss
from trainer.batching import MicroBatch
from trainer.config import TrainerConfig
from trainer.device import Placement
from trainer.distributed import DataParallel
from trainer.loss import LossInputs, kl_estimate, policy_loss
from trainer.router_replay import replay_routes
from trainer.step_metrics import LOSS_SUMS, STEP_SUMS, StepMetrics, fill_means, update_watch

log = logging.getLogger(__name__)


def _trainable_hidden(
    model: torch.nn.Module, mb: MicroBatch, config: TrainerConfig
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(hidden [N, H] at the positions predicting trainable tokens / temperature, LM head weight [V, H])``."""
    decoder = model.get_decoder()  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
    head = model.get_output_embeddings()  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
    if getattr(head, "bias", None) is not None:
        raise ValueError("LM heads with a bias are not supported")
    if mb.prefix_ids is not None:
        hidden = _suffix_hidden(decoder, mb)
    else:
        with replay_routes(model, mb.routes if config.router_replay else None):  # MoE: serving's experts
            hidden = decoder(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    hidden = hidden.reshape(-1, hidden.shape[-1]).index_select(0, mb.hidden_index)
    if config.loss.temperature != 1.0:
        hidden = hidden / config.loss.temperature  # logits / T == (h / T) W^T
    weight = head.weight
    if torch.is_autocast_enabled(hidden.device.type):  # the LM head in autocast's dtype, as nn.Linear
        dtype = torch.get_autocast_dtype(hidden.device.type)  # would be; the kernels accumulate in fp32
        hidden, weight = hidden.to(dtype), weight.to(dtype)
    return hidden, weight


def _suffix_hidden(decoder: torch.nn.Module, mb: MicroBatch) -> torch.Tensor:
    """``[B, Ls, H]`` hidden states of the rows' suffixes in the shared-prefix layout
    (:mod:`trainer.batching`): one decoder pass over the concatenated prefixes ``[1, Np]`` (a
    block-diagonal causal mask: each prefix attends to itself), each row's prefix keys and values
    gathered to ``[B, kv_heads, Lp, head_dim]``, then the suffixes attending to them at positions
    continuing each row's prefix. Gradients reach a prefix's activations once, summed over its rows."""
    assert mb.prefix_positions is not None and mb.prefix_gather is not None  # the shared-prefix layout
    assert mb.prefix_mask is not None and mb.prefix_lengths is not None
    segment = (mb.prefix_positions[0] == 0).cumsum(0)  # [Np] which prefix each token belongs to
    causal = torch.ones(len(segment), len(segment), dtype=torch.bool, device=segment.device).tril()
    blocks = (segment[:, None] == segment[None, :]) & causal  # [Np, Np] True: attend
    prefix = decoder(
        input_ids=mb.prefix_ids, position_ids=mb.prefix_positions, attention_mask=blocks[None, None], use_cache=True
    ).past_key_values
    rows, width = mb.prefix_gather.shape
    flat = mb.prefix_gather.reshape(-1)
    cache = DynamicCache()
    for layer, entry in enumerate(prefix.layers):  # keys/values [1, kv_heads, Np, head_dim]
        keys, values = (
            t[0].index_select(1, flat).unflatten(1, (rows, width)).transpose(0, 1) for t in (entry.keys, entry.values)
        )
        cache.update(keys, values, layer)
    mask = torch.cat([mb.prefix_mask, mb.attention_mask], dim=1)
    width = mb.input_ids.shape[1]
    positions = mb.prefix_lengths[:, None] + torch.arange(width, device=mb.input_ids.device)[None, :]
    out = decoder(
        input_ids=mb.input_ids, attention_mask=mask, position_ids=positions, past_key_values=cache, use_cache=True
    )
    return out.last_hidden_state


def token_logprobs(model: torch.nn.Module, mb: MicroBatch, config: TrainerConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-probs and entropies of a micro-batch's trainable tokens under ``model``.

    Returns:
        ``(logprobs [N], entropy [N])`` fp32, nats, of ``softmax(logits / temperature)``.

    Raises:
        ValueError: the LM head has a bias (not supported by the fused path).
    """
    hidden, weight = _trainable_hidden(model, mb, config)
    torch_path = config.logprob_backend == "torch" or (config.logprob_backend == "auto" and not hidden.is_cuda)
    # the chunk size is in tokens for the torch path; the Triton kernel keeps its own vocabulary tile
    chunk = config.logprob_chunk_size if torch_path else None
    return chunked_logprobs(hidden, weight, mb.targets, chunk, config.logprob_backend)


def micro_batch_loss(
    model: torch.nn.Module, mb: MicroBatch, config: TrainerConfig
) -> tuple[torch.Tensor, dict[str, float]]:
    """The policy loss of one micro-batch, fused with the LM head (:mod:`kernels.logprob_loss`).

    Returns:
        ``(loss [] differentiable, sums)`` where ``sums`` adds up :class:`LossOutputs` fields and
        the entropy over the micro-batch's trainable tokens.
    """
    hidden, weight = _trainable_hidden(model, mb, config)
    sums: dict[str, float] = {}
    old = mb.old_logprobs
    assert old is not None  # pi_old is set before the steps (compute_old_logprobs or the behaviour's)

    def token_loss(lp: torch.Tensor, sl: slice) -> torch.Tensor:
        out = policy_loss(
            LossInputs(
                logprobs=lp,
                old_logprobs=old[sl],
                behaviour_logprobs=mb.behaviour_logprobs[sl],
                advantages=mb.advantages[sl],
                loss_mask=torch.ones_like(lp, dtype=torch.bool),
                ref_logprobs=old[sl],
            ),
            normalizer=config.normalizer(),
            is_cap=config.loss.is_cap,
            clip_eps_low=config.loss.clip_eps_low,
            clip_eps_high=config.loss.clip_eps_high,
            kl_coef=config.loss.kl_coef,
            kl_estimator=config.loss.kl_estimator,
            ratio_cap=config.loss.is_cap if config.pi_old == "behaviour" else None,
        )
        for key in LOSS_SUMS:
            sums[key] = sums.get(key, 0.0) + float(getattr(out, key))
        return out.loss

    loss, _, entropy = chunked_logprob_loss(
        hidden, weight, mb.targets, token_loss, config.logprob_chunk_size, config.logprob_backend
    )
    sums["entropy_sum"] = float(entropy.sum())
    return loss, sums


def _autocast(placement: "Placement | None") -> contextlib.AbstractContextManager:
    return placement.autocast() if placement is not None else contextlib.nullcontext()


@torch.no_grad()
def compute_old_logprobs(
    model: torch.nn.Module,
    batches: list[MicroBatch],
    config: TrainerConfig,
    *,
    placement: "Placement | None" = None,
    dp: "DataParallel | None" = None,
) -> dict[str, float]:
    """Fill ``mb.old_logprobs`` with the parent policy's log-probs; return mismatch statistics.

    Args:
        placement: device policy (its autocast wraps the forward passes); None: as stored.
        dp: data-parallel group: each rank scores the micro-batches it owns and broadcasts them.

    Returns:
        ``{"mismatch_kl", "mismatch_is_clip_frac", "old_entropy"}`` averaged over trainable tokens.
    """
    was_training = model.training
    model.eval()
    kl = clipped = ent = n = 0.0
    with _autocast(placement):
        if dp is None:
            scored = {i: token_logprobs(model, mb, config) for i, mb in enumerate(batches)}
        else:  # this rank's share (sharded: through the FSDP root, forward passes padded to match)
            scored = dp.score(batches, lambda policy, mb: token_logprobs(policy, mb, config), model)
    for i, (lp, entropy) in scored.items():
        mb = batches[i]
        mb.old_logprobs = lp.detach()
        log_is = mb.old_logprobs - mb.behaviour_logprobs
        kl += float(kl_estimate(mb.old_logprobs, mb.behaviour_logprobs).sum())
        clipped += float((log_is > math.log(config.loss.is_cap)).sum())
        ent += float(entropy.sum())
        n += mb.num_trainable
    if dp is not None:
        dp.share_old_logprobs(batches)
        kl, clipped, ent, n = (
            dp.all_reduce_sums({"kl": kl, "clipped": clipped, "ent": ent, "n": n}, batches[0].targets.device)[k]
            for k in ("kl", "clipped", "ent", "n")
        )
    model.train(was_training)
    n = max(n, 1.0)
    return {"mismatch_kl": kl / n, "mismatch_is_clip_frac": clipped / n, "old_entropy": ent / n}


def use_behaviour_logprobs(batches: list[MicroBatch]) -> None:
    """``pi_old = "behaviour"``: set each micro-batch's ``old_logprobs`` to its behaviour log-probs
    (the same tensor), instead of :func:`compute_old_logprobs`."""
    for mb in batches:
        mb.old_logprobs = mb.behaviour_logprobs


def micro_batch_schedule(batches: list, config: TrainerConfig) -> Iterator[list]:
    """Micro-batches per optimizer step: each of ``config.epochs`` epochs shuffles ``batches`` and
    splits them into steps of ``grad_accum``, so every micro-batch is trained once per epoch (a step
    never holds a micro-batch twice nor spans two epochs). The cycle sizes its data to the step
    budget beforehand (``trainer.training.fit_claim_to_budget``), never by cutting this schedule short."""
    g = torch.Generator().manual_seed(config.seed)
    for _ in range(config.epochs):
        order = torch.randperm(len(batches), generator=g).tolist()
        for s in range(0, len(order), config.grad_accum):
            yield [batches[i] for i in order[s : s + config.grad_accum]]


def planned_steps(num_batches: int, config: TrainerConfig) -> int:
    """How many optimizer steps :func:`micro_batch_schedule` yields for ``num_batches``."""
    return config.epochs * math.ceil(num_batches / config.grad_accum)


def make_optimizer(model: torch.nn.Module, config: TrainerConfig) -> torch.optim.Optimizer:
    """AdamW over the trainable parameters (tied weights once)."""
    o = config.optim
    return torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad],
        lr=o.lr,
        betas=o.betas,
        eps=o.eps,
        weight_decay=o.weight_decay,
    )


def train_steps(
    model: torch.nn.Module,
    batches: list[MicroBatch],
    config: TrainerConfig,
    optimizer: torch.optim.Optimizer,
    *,
    on_step: Callable[[StepMetrics], None] | None = None,
    placement: "Placement | None" = None,
    dp: "DataParallel | None" = None,
) -> list[StepMetrics]:
    """Run the cycle's optimizer steps (needs ``old_logprobs`` filled: :func:`compute_old_logprobs`
    or :func:`use_behaviour_logprobs`). Returns per-step metrics.

    ``placement``'s autocast wraps each micro-batch's forward pass (not the backward). With ``dp``
    each rank runs its share of every step's micro-batches through DDP, which sums the gradients over
    ranks, and the metric sums are summed before clipping (:mod:`trainer.distributed`); metrics are global.

    A micro-batch whose loss is not finite is skipped (no backward; counted in
    ``StepMetrics.skipped_micro_batches``, logged), and a step whose micro-batches were all skipped
    or whose gradient norm is not finite takes no optimizer step (``skipped_step``): a NaN never
    reaches the weights, so never a checkpoint. A step that :func:`update_watch` stops takes no
    optimizer step either and is the last one (``StepMetrics.stopped_early``).
    """
    if any(mb.old_logprobs is None for mb in batches):
        raise ValueError("old_logprobs not filled: call compute_old_logprobs or use_behaviour_logprobs first")
    model.train()
    history = []
    if dp is not None:
        dp.attach(model, lambda policy, mb: micro_batch_loss(policy, mb, config))
    for step, group in enumerate(micro_batch_schedule(batches, config), start=1):
        lr = (
            config.optim.lr * min(1.0, step / config.optim.warmup_steps)
            if config.optim.warmup_steps
            else config.optim.lr
        )
        for pg in optimizer.param_groups:
            pg["lr"] = lr
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        m = StepMetrics(step=step, lr=lr)
        sums = _accumulate_gradients(model, group, m, config, placement, dp)
        if dp is not None:
            dp.finish_step()  # every rank joins the step's gradient all-reduce
            sums = _sum_over_ranks(dp, m, sums, batches[0].targets.device)
        clip = torch.nn.utils.clip_grad_norm_ if dp is None else dp.clip_grad_norm  # sharded: DTensor gradients
        m.grad_norm = float(clip(model.parameters(), config.optim.max_grad_norm))
        fill_means(m, sums)
        m.stopped_early = update_watch(m, config) if m.trainable_tokens else None  # global: ranks agree
        m.skipped_step = (
            m.skipped_micro_batches == len(group) or not math.isfinite(m.grad_norm) or m.stopped_early is not None
        )
        _log_skipped(m, len(group))
        if m.skipped_step:
            optimizer.zero_grad(set_to_none=True)
        else:
            optimizer.step()
        m.seconds = time.perf_counter() - start
        m.tokens_per_s = m.tokens / max(m.seconds, 1e-9)
        history.append(m)
        if on_step is not None:
            on_step(m)
        if m.stopped_early is not None:
            break
    if dp is not None:
        dp.detach()
    return history


def _accumulate_gradients(
    model: torch.nn.Module,
    group: list[MicroBatch],
    m: StepMetrics,
    config: TrainerConfig,
    placement: "Placement | None",
    dp: "DataParallel | None",
) -> dict[str, float]:
    """Forward and backward over this rank's micro-batches of one step, skipping any whose loss is
    not finite; counts tokens into ``m`` and returns the step's sums (:data:`STEP_SUMS`)."""
    sums = dict.fromkeys(STEP_SUMS, 0.0)
    local = group if dp is None else dp.local(group)
    for i, mb in enumerate(local):
        with _autocast(placement):  # data parallel: DDP's forward, no_sync() but on this rank's last
            loss, mb_sums = micro_batch_loss(model, mb, config) if dp is None else dp.loss(mb, i == len(local) - 1)
        if not torch.isfinite(loss.detach()):
            m.skipped_micro_batches += 1
            log.warning(
                "step %d: a micro-batch's loss is %s; skipped (%d tokens)",
                m.step,
                float(loss.detach()),
                mb.num_tokens,
            )
            continue
        loss.backward()
        m.loss += float(loss.detach())
        mb_sums["adv"], mb_sums["advabs"] = float(mb.advantages.sum()), float(mb.advantages.abs().sum())
        for key, value in mb_sums.items():
            sums[key] = sums.get(key, 0.0) + value
        m.trainable_tokens += mb.num_trainable
        m.tokens += mb.num_tokens
        m.computed_tokens += mb.computed_tokens
    return sums


def _sum_over_ranks(dp: DataParallel, m: StepMetrics, sums: dict[str, float], device: torch.device) -> dict[str, float]:
    """Data parallel: the step's sums and ``m``'s counts summed over ranks (``m`` updated in place),
    so every rank reports and decides on global metrics."""
    totals = dp.all_reduce_sums(
        {
            **sums,
            "loss": m.loss,
            "trainable": m.trainable_tokens,
            "tokens": m.tokens,
            "computed": m.computed_tokens,
            "skipped": m.skipped_micro_batches,
        },
        device,
    )
    m.loss = totals.pop("loss")
    m.trainable_tokens, m.tokens = int(totals.pop("trainable")), int(totals.pop("tokens"))
    m.computed_tokens = int(totals.pop("computed"))
    m.skipped_micro_batches = int(totals.pop("skipped"))
    return totals


def _log_skipped(m: StepMetrics, micro_batches: int) -> None:
    if m.stopped_early is not None:
        log.warning("step %d: %s; no update, the cycle's remaining steps are not run", m.step, m.stopped_early)
    elif m.skipped_step:
        log.warning(
            "step %d: no optimizer step (%d of %d micro-batches skipped, gradient norm %s)",
            m.step,
            m.skipped_micro_batches,
            micro_batches,
            m.grad_norm,
        )

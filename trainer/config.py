"""Typed configuration of a training cycle (after prime-rl's ``configs/trainer.py``).

Invariant: a config is either fully valid or refused at load time. Every model forbids unknown
keys (a typo in the TOML is an error, not a silently ignored knob), every number has bounds, and the
resolved config (defaults filled in) is written as ``trainer_config.json`` next to each checkpoint.

Hand-written TOML in: ``trainer/configs/default.toml`` (small CPU defaults) or ``--config FILE``.
"""

from __future__ import annotations

import json
import tomllib
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from app.core.errors import ConfigurationError

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "default.toml"


class _Config(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


class DataConfig(_Config):
    """Which trajectories a cycle trains on and how they are batched."""

    reward_spec: str = Field(default="implicit@4", pattern=r"^[\w.-]+@[\w.-]+$")
    """Reward spec ``name@version`` whose ``reward_label`` rows are the rewards."""
    min_new_trajectories: int = Field(default=8, ge=1)
    """Skip the cycle when fewer usable trajectories arrived since the last one."""
    max_trajectories: int = Field(default=2048, ge=1)
    """At most this many trajectories per cycle (oldest first); the rest wait for the next cycle."""
    max_staleness_generations: int = Field(default=2, ge=0)
    """Drop a trajectory served by a checkpoint more than this many generations older than the
    checkpoint being trained (0: only on-policy data)."""
    max_age_hours: float = Field(default=48.0, gt=0)
    """Drop a trajectory whose last event is older than this (hours); also bounds the window
    whose trajectories are enumerated in the manifest."""
    max_seq_len: int = Field(default=2048, ge=16)
    """Segments longer than this (tokens) are truncated; later tokens are not trained on."""
    micro_batch_tokens: int = Field(default=2048, ge=16)
    """Padded tokens (rows x longest row) per micro-batch; bounds activation memory."""
    share_prefixes: bool = False
    """Pack each task group's rows together and compute their common prefix (the group's prompt)
    once per micro-batch (``trainer/batching.py``); the loss and gradients are those of whole rows.
    Off by default: on the 2-core CPU it computed 30-40 % fewer tokens but was not measurably faster
    (``bench/shared_prefix.py``, docs/benchmarks.md). Not with ``gradient_checkpointing`` (its
    layers keep no key/value cache) or MoE routes: then rows are packed whole."""
    min_group_reward_range: float = Field(default=0.0, ge=0)
    """Leave out every task group of two or more trajectories whose rewards span less than this
    (``max - min``, reward units): they stay new, excluded with reason ``low_reward_contrast``
    (:meth:`trainer.data.CycleData.exclude_low_contrast`). 0: train every group."""
    singleton_baseline: Literal["zero", "batch_mean"] = "batch_mean"
    """Baseline of a trajectory alone in its task group: 0 advantage, or reward minus batch mean."""
    placebo: bool = False
    """The placebo arm: shuffle each cycle's rewards (seeded by ``seed`` and the cycle's trajectory
    ids) before the advantages are computed, so a gain of the placebo run is not learning from the
    reward (Shao et al. 2025, "Spurious Rewards"). Recorded in the manifest."""
    placebo_mode: Literal["within_group", "across_cycle"] = "within_group"
    """How the placebo shuffles: ``within_group`` permutes rewards among each task group's
    trajectories, so every group keeps its rewards' mean and spread and the placebo's advantages are
    exactly as large as the real run's (matched in step size); ``across_cycle`` (the placebo before
    2026-12-02) permutes them across the whole cycle, which mixes groups: the advantages, not scaled
    by a group's spread, come out 1.2-1.3x larger under the docs' reward model (issue 70)."""
    same_data_as: str | None = None
    """Train on exactly the trajectories checkpoint ``same_data_as`` trained on (already claimed:
    ablations and planted regressions), instead of the new ones."""


class LossConfig(_Config):
    """The policy loss (see ``trainer/loss.py`` for the equations and papers)."""

    is_cap: float = Field(default=2.0, gt=0)
    """Truncation ``C`` of the importance weight ``pi_old / mu`` (IMPALA / TIS); with
    ``pi_old = "behaviour"``, of the weight ``pi_theta / mu`` that the ratio puts on a token."""
    clip_eps_low: float = Field(default=0.2, ge=0, lt=1)
    """PPO clip range below 1."""
    clip_eps_high: float = Field(default=0.2, ge=0)
    """PPO clip range above 1 (> clip_eps_low: DAPO's clip-higher)."""
    kl_coef: float = Field(default=0.0, ge=0)
    """Weight of the KL penalty to the parent checkpoint (0: off; KL is still reported)."""
    kl_estimator: Literal["k1", "k3"] = "k3"
    """KL estimator (Schulman 2020)."""
    normalizer_tokens: int | None = Field(default=None, ge=1)
    """Constant loss normalizer ``Z`` in tokens (Dr. GRPO); default micro_batch_tokens x grad_accum."""
    temperature: float = Field(default=0.7, gt=0)
    """Sampling temperature of the serving engine: the trainer's log-probs are of
    ``softmax(logits / temperature)``, the distribution the behaviour log-probs came from."""


class OptimConfig(_Config):
    """AdamW (Loshchilov & Hutter 2019) with global-norm gradient clipping."""

    lr: float = Field(default=2e-6, gt=0, le=1e-2)
    """Peak learning rate."""
    warmup_steps: int = Field(default=0, ge=0)
    """Linear warmup steps (then constant)."""
    betas: tuple[float, float] = (0.9, 0.95)
    """Adam betas."""
    eps: float = Field(default=1e-8, gt=0)
    """Adam epsilon."""
    weight_decay: float = Field(default=0.0, ge=0)
    """Decoupled weight decay (0: none; RL fine-tuning steps are few)."""
    max_grad_norm: float = Field(default=1.0, gt=0)
    """Clip the global gradient norm to this."""

    @model_validator(mode="after")
    def _betas_in_range(self) -> "OptimConfig":
        if not all(0.0 <= b < 1.0 for b in self.betas):
            raise ValueError(f"betas must lie in [0, 1), got {self.betas}")
        return self


class LoraSettings(_Config):
    """Low-rank adapters (LoRA, Hu et al. 2021) through ``peft``: the cycle trains rank-``rank``
    adapters on the decoder's linear layers with the parent's weights frozen, then merges them into
    those weights, so a checkpoint is a whole model either way and serving never sees an adapter.
    Thinking Machines' "LoRA Without Regret" (2025): rank 16-64 on every layer at about 10x the
    full fine-tuning learning rate matches full fine-tuning for RL."""

    rank: int = Field(default=0, ge=0, le=1024)
    """Adapter rank ``r``; 0 trains every weight (full fine-tuning)."""
    alpha: float = Field(default=32.0, gt=0)
    """Scale numerator: the adapter's update is ``(alpha / rank) * B @ A``."""
    target_modules: str | list[str] = "all-linear"
    """Which linear layers get adapters (``peft.LoraConfig.target_modules``): ``all-linear`` is every
    linear layer but the LM head."""


class ParallelConfig(_Config):
    """How ``torchrun`` ranks share the model (``trainer/distributed.py``, ``trainer/sharding.py``).
    Outside torchrun (one process) the mode has no effect."""

    mode: Literal["ddp", "fsdp"] = "ddp"
    """``ddp``: every rank holds the whole model, gradients all-reduced (``DistributedDataParallel``);
    for models whose fp32 weights, gradients and AdamW state fit one device. ``fsdp``: weights,
    gradients and AdamW state sharded over the ranks (FSDP2 ``fully_shard``, per decoder layer, then
    the root holding the tied embeddings / LM head, the final norm); each layer is gathered only
    while it computes."""
    reshard_after_forward: bool = True
    """``fsdp``: free each layer's gathered weights after its forward and gather them again for its
    backward (ZeRO-3); false keeps them from forward to backward (ZeRO-2: less traffic, more memory)."""
    cpu_offload: bool = False
    """``fsdp`` on CUDA: keep the sharded fp32 weights, gradients and AdamW state in host memory
    (``CPUOffloadPolicy``; the optimizer step runs on the CPU). Refused on a CPU device."""


class TrainerConfig(_Config):
    """One training cycle: data, loss, optimizer and run settings."""

    epochs: int = Field(default=1, ge=1)
    """Passes over the cycle's micro-batches; every epoch visits every one of them once, so the
    optimizer steps follow the data: ``epochs * ceil(micro_batches / grad_accum)``."""
    max_steps: int | None = Field(default=None, ge=1)
    """Compute budget of a cycle in optimizer steps: the cycle then claims only the trajectories
    whose micro-batches fit in it (whole task groups, newest deferred first); the rest stay new
    for the next cycle. None: no budget beyond ``data.max_trajectories``."""
    grad_accum: int = Field(default=2, ge=1)
    """Micro-batches accumulated per optimizer step."""
    invert_reward: bool = False
    """Train on the negated reward: a planted regression the gate must reject (bench, drills)."""
    seed: int = 0
    """Seed of every draw of the cycle: the micro-batch order, the step schedule, the LoRA adapters'
    initialisation and the placebo's permutation (``flywheel train --seed``; in the manifest)."""
    threads: int = Field(default=2, ge=1, le=256)
    """torch intra-op threads."""
    device: Literal["auto", "cpu", "cuda"] = "auto"
    """Where the cycle trains (``trainer/device.py``): ``cuda`` = TF32 and the Triton log-prob kernel;
    ``cpu`` = the chunked torch log-prob path; ``auto`` = CUDA when a GPU is visible. Under torchrun
    each rank uses ``cuda:LOCAL_RANK``. Weights and AdamW state are fp32 on both (``precision``)."""
    precision: Literal["auto", "bf16", "fp32"] = "auto"
    """Compute dtype of the forward passes (``trainer/device.py``); master weights and AdamW state
    stay fp32. ``bf16`` = ``torch.autocast`` bf16 (on a CPU without ``amx_bf16``/``avx512_bf16``
    emulated, slower than fp32); ``fp32`` = no autocast (and no TF32 on CUDA); ``auto`` = bf16 on
    CUDA and on CPUs where bf16 matmuls are measured faster than fp32
    (``app.inference.precision.bf16_is_faster``), else fp32. The resolved value is recorded as
    ``placement.precision`` in the checkpoint's manifest and metrics."""
    pi_old: Literal["recompute", "behaviour"] = "recompute"
    """The PPO ratio's reference (``trainer/loss.py``): ``recompute`` scores every trainable token
    under the parent checkpoint before the first update (one extra forward pass over the cycle's
    data); ``behaviour`` uses the log-probs recorded at serving time (mu) as pi_old and skips that
    pass: the ratio is ``pi_theta / mu`` with its weight truncated at ``loss.is_cap``. Needs
    ``epochs = 1`` (each micro-batch trained in one optimizer step only)."""
    max_kl_per_token: float | None = Field(default=None, gt=0)
    """Stop the cycle's remaining optimizer steps once a step's forward pass measures a mean KL to
    pi_old above this (nats per trainable token, the step's ``kl`` metric); that step takes no
    update either. The cycle still writes its checkpoint, with ``stopped_early`` in the manifest
    and metrics. None: no limit."""
    min_entropy: float | None = Field(default=None, ge=0)
    """Stop the cycle's remaining steps, as ``max_kl_per_token`` does, once a step's mean entropy of
    the next-token distribution falls below this (nats per trainable token). None: no limit."""
    logprob_backend: Literal["auto", "torch", "triton"] = "auto"
    """Log-prob path: Triton kernel on CUDA, chunked torch elsewhere (``auto``)."""
    logprob_chunk_size: int = Field(default=1024, ge=1)
    """Tokens per chunk of the torch log-prob path (the Triton kernel uses its own vocabulary tile,
    ``kernels.logprobs.BLOCK_V``)."""
    gradient_checkpointing: bool = False
    """Recompute decoder activations in backward (less memory, ~30% more compute)."""
    save_optimizer: bool = False
    """Also write ``optimizer.pt`` (AdamW state) into the checkpoint."""
    plot_curves: bool = True
    """Write ``curves.png`` (per-step metrics) into the checkpoint."""
    router_replay: bool = True
    """MoE policies: route each sampled token through the experts the serving engine recorded for
    it (R3 router replay, ``trainer/router_replay.py``); false routes every token by the trainer's
    own router. No effect on a dense model or on segments stored without routes."""
    data: DataConfig = DataConfig()
    loss: LossConfig = LossConfig()
    optim: OptimConfig = OptimConfig()
    lora: LoraSettings = LoraSettings()
    parallel: ParallelConfig = ParallelConfig()

    @model_validator(mode="after")
    def _schedule_is_consistent(self) -> "TrainerConfig":
        if self.max_steps is not None and self.max_steps < self.epochs:
            raise ValueError(
                f"max_steps={self.max_steps} cannot cover epochs={self.epochs} (one step per epoch at least)"
            )
        if self.pi_old == "behaviour" and self.epochs > 1:
            raise ValueError(
                f'pi_old = "behaviour" needs epochs = 1, got epochs={self.epochs}: after the first epoch the '
                'policy has moved, and mu is no longer the policy the trust region starts from (use "recompute")'
            )
        if self.lora.rank and self.save_optimizer:
            raise ValueError(
                "save_optimizer with lora.rank > 0: the AdamW state is the adapters', which are merged "
                "into the checkpoint's weights and gone; there is nothing for it to resume"
            )
        if self.parallel.mode == "fsdp":
            self._fsdp_is_supported()
        return self

    def _fsdp_is_supported(self) -> None:
        refused = {
            "lora.rank > 0": self.lora.rank > 0,  # peft's adapters are not sharded (untested with fully_shard)
            "save_optimizer": self.save_optimizer,  # the AdamW state is sharded: no single optimizer.pt
            # every rank must run the same collectives; a shared-prefix micro-batch runs the decoder twice
            "data.share_prefixes": self.data.share_prefixes,
            "parallel.cpu_offload with device cpu": self.parallel.cpu_offload and self.device == "cpu",
        }
        named = [k for k, v in refused.items() if v]
        if named:
            raise ValueError(f'parallel.mode = "fsdp" does not support {", ".join(named)}')

    def normalizer(self) -> float:
        """The constant loss normalizer ``Z`` (tokens)."""
        return float(self.loss.normalizer_tokens or self.data.micro_batch_tokens * self.grad_accum)

    def to_json(self) -> str:
        """The resolved config as JSON (what ``trainer_config.json`` holds)."""
        return json.dumps(self.model_dump(mode="json"), indent=2, sort_keys=True)


def load_config(path: Path | None = None, overrides: dict[str, Any] | None = None) -> TrainerConfig:
    """Read a TOML trainer config (default: the packaged ``default.toml``) and apply overrides.

    A config may start from another with a top-level ``extends = "FILE"`` (relative to the file
    that names it): that file is read first (itself possibly extending another) and this one's
    tables are merged over it key by key, so a variant states only what it changes.

    Args:
        path: TOML file; ``None`` for ``trainer/configs/default.toml``.
        overrides: dotted keys to values, e.g. ``{"max_steps": 2, "optim.lr": 1e-6}`` (CLI flags).

    Raises:
        ConfigurationError: unreadable TOML, an ``extends`` chain that loops or names a missing
            file, unknown keys or out-of-bounds values (every reason).
    """
    path = Path(path) if path else DEFAULT_CONFIG
    raw = _read_extended(path, ())
    for dotted, value in (overrides or {}).items():
        node = raw
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    try:
        return TrainerConfig.model_validate(raw)
    except ValidationError as exc:
        reasons = [f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()]
        raise ConfigurationError(f"invalid trainer config {path}", reasons=reasons) from None


def _read_extended(path: Path, chain: tuple[Path, ...]) -> dict[str, Any]:
    """The TOML at ``path`` merged over the file its ``extends`` key names, recursively.

    Raises:
        ConfigurationError: unreadable TOML, a non-string ``extends``, or a loop of ``extends``.
    """
    resolved = path.resolve()
    if resolved in chain:
        loop = " -> ".join(str(p) for p in (*chain, resolved))
        raise ConfigurationError(f"trainer config extends itself: {loop}")
    try:
        raw = tomllib.loads(path.read_text())
    except (OSError, tomllib.TOMLDecodeError) as exc:
        raise ConfigurationError(f"cannot read trainer config {path}: {exc}") from None
    parent = raw.pop("extends", None)
    if parent is None:
        return raw
    if not isinstance(parent, str):
        raise ConfigurationError(f"{path}: extends must be a file name, got {parent!r}")
    return _merge(_read_extended(path.parent / parent, (*chain, resolved)), raw)


def _merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into ``base``: tables merge key by key, any other value replaces."""
    merged = dict(base)
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged

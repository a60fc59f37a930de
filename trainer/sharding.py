"""Sharded data parallel with FSDP2 (``torch.distributed.fsdp.fully_shard``): the trainer's mode for
models whose fp32 weights, gradients and AdamW state do not fit one device (``parallel.mode =
"fsdp"`` under torchrun). :class:`ShardedDataParallel` keeps :class:`trainer.distributed.DataParallel`'s
interface and invariants (rank 0 alone touches the outside world; the same result as one process);
what differs is how the model is held and how gradients are reduced.

- **Sharding.** Each decoder layer is its own FSDP unit, then the root (:class:`ShardedPolicy`, the
  policy wrapped so that the micro-batch loss is the root's ``forward``) holds what is left: the
  embeddings tied to the LM head, the final norm. The tied weight stays one parameter in one unit,
  as prime-rl and verl do (they do not shard ``lm_head`` separately). Every parameter is a
  ``DTensor`` sharded on dim 0 over a 1-D mesh (``init_device_mesh``: NCCL on CUDA, gloo on CPUs,
  PyTorch issue #132471), and AdamW's state is created sharded beside it.
- **Gradients are summed, not averaged**: each FSDP unit's gradient divide factor is 1, so the
  reduce-scatter of every backward sums the ranks' gradients (the loss is divided by a constant
  token count, Dr. GRPO) and the sharded gradients accumulate over a step's micro-batches: the
  single-process gradient up to summation order.
- **Every rank runs the same collectives.** FSDP2 gathers each layer in its forward (and, resharded,
  again in its backward) and reduce-scatters it in its backward, so every rank runs
  ``ceil(len(step's micro-batches) / world)`` forward + backward passes per step. A rank short of a
  micro-batch runs a *filler* pass (a micro-batch of the step whose backward carries zero), and a
  micro-batch whose loss is not finite backpropagates that zero instead of its loss: the zero is
  built from every decoder layer's output and every root parameter (:meth:`ShardedPolicy.forward`),
  so each unit's backward runs, with zero gradients while the activations are finite. (Non-finite
  activations make the zero's gradient NaN too: the gradient norm is then not finite and the whole
  step is skipped, where one process would skip only that micro-batch; no NaN reaches the weights.)
  The pi_old pass pads its forward passes the same way.
- **Mixed precision**: ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`` when the
  placement computes in bf16: layers gather bf16 weights, gradients are reduced in fp32 into the
  fp32 shards AdamW updates. ``parallel.cpu_offload`` (CUDA): ``CPUOffloadPolicy``, the shards,
  gradients and optimizer state live in host memory.
- **Publishing**: :meth:`ShardedDataParallel.full_model` gathers the full fp32 state dict onto rank 0's
  CPU (``get_model_state_dict(full_state_dict=True, cpu_offload=True)``) into an unsharded copy of
  the model, which the checkpoint writer saves as ``model.safetensors`` for serving.
- **Gradient clipping** over ``DTensor`` gradients: :func:`clip_grad_norm` (the total norm's
  partial sums reduced over ranks before the clip coefficient, as verl's ``fsdp2_clip_grad_norm_``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor
from transformers import AutoModelForCausalLM

from app.core.errors import ConfigurationError
from trainer.config import ParallelConfig
from trainer.device import Placement
from trainer.distributed import DataParallel, LossFn
from trainer.router_replay import moe_routers


def decoder_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The decoder layers of a Hugging Face causal LM (``model.get_decoder().layers``).

    Raises:
        ValueError: the model's decoder has no ``layers`` list.
    """
    layers = getattr(model.get_decoder(), "layers", None)  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
    if layers is None:
        raise ValueError(f"{type(model).__name__}: its decoder has no .layers to shard")
    return list(layers)


class ShardedPolicy(torch.nn.Module):
    """The root FSDP unit: the policy, with ``forward(fn, mb)`` returning ``(fn(policy, mb), zero)``.

    Running the micro-batch loss (or the pi_old scoring) inside the root's ``forward`` is what makes
    FSDP2 gather the root's parameters (embeddings / tied LM head, final norm) for it: the trainer
    calls the decoder and reads the LM head's weight separately (:mod:`trainer.step`). ``zero`` is a
    scalar 0 whose backward reaches every decoder layer (through its output) and every root
    parameter; see the module docstring for when it is backpropagated.
    """

    def __init__(self, policy: torch.nn.Module) -> None:
        super().__init__()
        self.policy = policy
        self._outputs: list[torch.Tensor] = []
        for layer in decoder_layers(policy):
            layer.register_forward_hook(self._keep_output)

    def _keep_output(self, module: torch.nn.Module, args: Any, output: Any) -> None:
        out = output[0] if isinstance(output, tuple) else output
        if isinstance(out, torch.Tensor) and out.requires_grad:
            self._outputs.append(out)

    def forward(self, fn: Callable[[torch.nn.Module, Any], Any], mb: Any) -> tuple[Any, torch.Tensor]:
        self._outputs = []
        result = fn(self.policy, mb)
        parts = [o.float().sum() for o in self._outputs]
        # inside the root's forward its own parameters are unsharded plain tensors; the layers' are DTensors
        parts += [
            p.reshape(-1)[0].float() for p in self.policy.parameters() if p.requires_grad and not isinstance(p, DTensor)
        ]
        self._outputs = []
        zero = torch.stack(parts).sum() * 0.0 if parts else torch.zeros(())
        return result, zero


def clip_grad_norm(parameters: Iterable[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """Clip the global L2 norm of the gradients to ``max_norm``; return the norm before clipping.

    Works on plain tensors and on FSDP2's sharded ``DTensor`` gradients (whose per-shard norms are
    reduced over the ranks into the global norm, a replicated scalar every rank agrees on).

    Returns:
        The total norm, a 0-d fp32 tensor (may be inf/NaN: the caller skips such a step).
    """
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.zeros(())
    total = torch.nn.utils.get_total_norm(grads, norm_type=2.0)
    if isinstance(total, DTensor):
        total = total.full_tensor()
    coef = min(max_norm / (float(total) + 1e-6), 1.0)  # torch.nn.utils.clip_grad_norm_'s coefficient
    if coef < 1.0:
        for g in grads:
            g.mul_(coef)
    return total


class ShardedDataParallel(DataParallel):
    """:class:`DataParallel` with the model sharded by FSDP2 over ``mesh`` (see the module docstring).

    Args:
        rank, world_size: as :class:`DataParallel`. mesh: 1-D device mesh of every rank.
        config: the ``[parallel]`` table (resharding, CPU offload).
    """

    def __init__(self, rank: int, world_size: int, mesh: DeviceMesh, config: ParallelConfig) -> None:
        super().__init__(rank, world_size)
        self.mesh, self.config = mesh, config
        self._root: ShardedPolicy | None = None
        self._loss_fn: LossFn | None = None
        self._passes = self._needed = 0
        self._filler: Any = None

    @property
    def sharded(self) -> bool:
        """True: the model's parameters are FSDP2 shards (:func:`shard` ran)."""
        return self._root is not None

    def shard(self, model: torch.nn.Module, placement: Placement) -> None:
        """Shard ``model`` (fp32, on the CPU or already on ``placement.device``) in place: each decoder
        layer, then the root. Call before creating the optimizer (its parameters become DTensors).

        Raises:
            ConfigurationError: ``model`` is MoE and this torch lacks
                ``FSDPModule.set_reduce_scatter_unused_params`` (before 2.13).
        """
        kwargs: dict[str, Any] = {"mesh": self.mesh, "reshard_after_forward": self.config.reshard_after_forward}
        if placement.compute_dtype != placement.param_dtype:
            kwargs["mp_policy"] = MixedPrecisionPolicy(param_dtype=placement.compute_dtype, reduce_dtype=torch.float32)
        if self.config.cpu_offload and placement.is_cuda:
            kwargs["offload_policy"] = CPUOffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, **kwargs)
        root = ShardedPolicy(model)
        fully_shard(root, **kwargs)
        # An MoE expert no token used gets zeros and joins the same collectives. torch 2.11 (outside the
        # pinned 2.13, but what GPU images often carry) lacks the switch: a dense model uses every
        # parameter, so it trains the same there; an MoE model is refused.
        unused_switch = hasattr(FSDPModule, "set_reduce_scatter_unused_params")
        if not unused_switch and moe_routers(model):
            raise ConfigurationError(f"FSDP2 on an MoE model needs torch >= 2.13 (this is {torch.__version__})")
        for unit in root.modules():
            if isinstance(unit, FSDPModule):
                unit.set_gradient_divide_factor(1.0)  # sum over ranks, not the mean
                unit.set_force_sum_reduction_for_comms(True)  # a plain SUM (gloo has no PREMUL_SUM)
                if unused_switch:
                    unit.set_reduce_scatter_unused_params(True)
        self._root = root

    def attach(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        """Remember the micro-batch loss (the model was sharded by :meth:`shard`)."""
        self._require_root()
        self._loss_fn = loss_fn
        self._passes = self._needed = 0

    def detach(self) -> None:
        """Forget the loss; the model stays sharded."""
        self._loss_fn = None

    def local(self, items: list[Any]) -> list[Any]:
        """This rank's share of a step's micro-batches (as :meth:`DataParallel.local`); also sets the
        step's pass count, ``ceil(len(items) / world)``, which :meth:`finish_step` pads to."""
        self._passes, self._needed = 0, math.ceil(len(items) / self.world_size)
        self._filler = items[0] if items else None
        return super().local(items)

    def loss(self, mb: Any, final: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, sums)`` of ``mb`` through the root's forward. A loss that is not finite (the
        caller skips it) has the pass's zero backpropagated here, so the ranks' collectives match."""
        root, loss_fn = self._require_root(), self._loss_fn
        if loss_fn is None:
            raise RuntimeError("ShardedDataParallel.attach must set the loss before its micro-batches run")
        self._passes += 1
        (loss, sums), zero = root(loss_fn, mb)
        if not torch.isfinite(loss.detach()):
            zero.backward()
        return loss, sums

    def finish_step(self) -> None:
        """Run this rank's filler passes up to the step's pass count (zero gradients)."""
        root, loss_fn = self._require_root(), self._loss_fn
        while self._passes < self._needed:
            self._passes += 1
            _, zero = root(loss_fn, self._filler)
            zero.backward()

    def score(self, batches: list[Any], fn: Callable[[torch.nn.Module, Any], Any], model: Any = None) -> dict[int, Any]:
        """``{i: fn(policy, batches[i])}`` for the micro-batches this rank owns (:meth:`owns`), each
        through the root's forward (no grad; ``model`` is the one the root wraps), padded with filler
        forwards to ``ceil(n / world)``."""
        root = self._require_root()
        mine = [i for i in range(len(batches)) if self.owns(i)]
        out = {}
        with torch.no_grad():
            for i in mine:
                out[i], _ = root(fn, batches[i])
            for _ in range(math.ceil(len(batches) / self.world_size) - len(mine)):
                root(fn, batches[0])
        return out

    def full_model(self, model: torch.nn.Module) -> torch.nn.Module | None:
        """Gather the sharded ``model``'s full fp32 weights (a collective: every rank calls it); rank 0
        gets an unsharded copy on the CPU, tied weights tied, the others None."""
        state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if not self.is_main:
            return None
        with torch.device("meta"):
            full = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
        full.load_state_dict(state, strict=False, assign=True)
        full.tie_weights()
        for name, buf in model.named_buffers():  # non-persistent buffers (rotary frequencies): not in the state dict
            owner, _, leaf = name.rpartition(".")
            module = full.get_submodule(owner)
            if module.get_buffer(leaf).is_meta:
                module.register_buffer(leaf, buf.detach().cpu().clone(), persistent=False)
        missing = [n for n, t in [*full.named_parameters(), *full.named_buffers()] if t.is_meta]
        if missing:
            raise RuntimeError(f"the gathered state dict lacks {missing[:5]}")
        return full.train()

    def _require_root(self) -> ShardedPolicy:
        if self._root is None:
            raise RuntimeError("ShardedDataParallel.shard must shard the model first")
        return self._root


def init_sharded(device: torch.device, config: ParallelConfig) -> ShardedDataParallel:
    """:class:`ShardedDataParallel` over every rank of the initialised default process group, on a
    1-D mesh of ``device``'s type (``init_device_mesh("cpu", (world,))`` with gloo on CPUs)."""
    world = dist.get_world_size()
    mesh = init_device_mesh(device.type, (world,))
    return ShardedDataParallel(dist.get_rank(), world, mesh, config)

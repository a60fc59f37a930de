"""Data-parallel training with ``torch.distributed`` (``flywheel train`` under ``torchrun``): the
process group, the DDP-wrapped micro-batch loss, and rank 0's broadcasts. It knows nothing of cycles
beyond :class:`CycleWork`; :func:`trainer.cycle.run_parallel_cycle` runs a cycle on every rank.

Invariants:

- **Rank 0 alone touches the outside world.** It takes the trainer lock, selects the cycle's
  trajectories, and broadcasts them (with the parent checkpoint's directory) to the other ranks; it
  alone writes the checkpoint, manifest and delta and registers the candidate. The other ranks never
  open the database nor the checkpoint store's staging area. A rank killed at any point makes
  torchrun stop the group; rank 0 has then published nothing (the store publishes atomically) or a
  directory that the next cycle's sweep removes, exactly as a killed single-process cycle.
- **Same result as one process.** Every optimizer step's micro-batches are split across ranks
  (rank ``r`` takes ``group[r::world]``). The gradients are reduced by PyTorch's
  ``DistributedDataParallel`` (DDP): the module it wraps (:class:`MicroBatchLoss`) has the
  micro-batch loss as its ``forward``, so the fused log-prob path (decoder and LM head weight run
  separately, :mod:`trainer.step`) goes through DDP's forward. Each rank accumulates its share
  under ``no_sync()`` and its last micro-batch's backward all-reduces the buckets, overlapped with
  that backward. The comm hook *sums* over ranks instead of DDP's mean: the loss is divided by a
  constant token count (Dr. GRPO), not by the number of micro-batches or ranks, so the sum is the
  single-process gradient up to floating-point summation order. Clipping and AdamW then run on
  identical gradients on every rank, so the replicas stay identical.
- **Every rank joins every step's all-reduce.** A rank left without a micro-batch (the last step
  of an epoch) or whose last loss is not finite (skipped, as in one process) backpropagates a zero
  that reaches every parameter, so its accumulated gradients are still reduced. The synced loss
  carries the same zero, so a parameter no micro-batch used (an MoE expert no token was routed to)
  is reduced as zeros instead of stalling DDP's reducer.
- ``pi_old`` is computed once per micro-batch, by the rank ``i % world`` that owns it, and
  broadcast to the others.

Replicated weights bound the model to one GPU's memory (Qwen3-0.6B: ~10 GB of fp32 weights,
gradients and AdamW state); past that size ``parallel.mode = "fsdp"`` shards them
(:mod:`trainer.sharding`, the same interface).

Backends: NCCL when the ranks train on CUDA, gloo on CPUs (the same code; tests run it).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from app.core.errors import ConfigurationError

T = TypeVar("T")
LossFn = Callable[[torch.nn.Module, Any], tuple[torch.Tensor, dict[str, float]]]


@dataclass(frozen=True)
class CycleWork:
    """What rank 0 broadcasts for one cycle: the parent's directory and the selected trajectories."""

    parent_dir: Path
    trajectories: list[Any]  # trainer.data.TrajectoryData


def zero_reaching_every_parameter(model: torch.nn.Module) -> torch.Tensor:
    """A scalar 0 whose backward gives every trainable parameter a zero gradient (one element each)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return torch.stack([p.reshape(-1)[0].float() for p in params]).sum() * 0.0


class MicroBatchLoss(torch.nn.Module):
    """The policy and its micro-batch loss as one module, so the loss is DDP's ``forward``.

    ``forward(mb, sync)`` returns ``loss_fn(policy, mb)``; with ``sync`` (the backward that
    all-reduces) the loss carries :func:`zero_reaching_every_parameter`; ``mb=None`` returns that
    zero alone, with empty sums.
    """

    def __init__(self, policy: torch.nn.Module, loss_fn: LossFn) -> None:
        super().__init__()
        self.policy, self.loss_fn = policy, loss_fn

    def forward(self, mb: Any, sync: bool) -> tuple[torch.Tensor, dict[str, float]]:
        if mb is None:
            return zero_reaching_every_parameter(self.policy), {}
        loss, sums = self.loss_fn(self.policy, mb)
        if sync:
            loss = loss + zero_reaching_every_parameter(self.policy)
        return loss, sums


def _sum_hook(dp, bucket):  # unannotated: DDP compares the annotations with objects, not strings
    """DDP comm hook: a future of the ``dist.GradBucket``'s gradients summed over ranks (DDP's own
    hook averages); counts the bucket in ``dp.reduced_buckets``."""
    dp.reduced_buckets += 1
    work = dist.all_reduce(bucket.buffer(), async_op=True)
    return work.get_future().then(lambda fut: fut.value()[0])


class DataParallel:
    """This process's place in an initialised default process group.

    Args:
        rank: this process's rank. world_size: the number of ranks.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._work_sent = False
        self._ddp: DistributedDataParallel | None = None
        self._prepared = False  # a synced forward ran this step: DDP expects its backward
        self._reduced_at_sync = 0
        self.reduced_buckets = 0  # gradient buckets all-reduced since attach (read by tests)

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that selects data, writes and registers)."""
        return self.rank == 0

    @property
    def sharded(self) -> bool:
        """Whether the model is sharded over the ranks (:class:`trainer.sharding.ShardedDataParallel`);
        False here: every rank holds the whole model."""
        return False

    def clip_grad_norm(self, parameters: Any, max_norm: float) -> torch.Tensor:
        """``torch.nn.utils.clip_grad_norm_`` (the gradients are whole and identical on every rank)."""
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)

    def score(self, batches: list[Any], fn: Callable[[torch.nn.Module, Any], Any], model: torch.nn.Module) -> dict:
        """``{i: fn(model, batches[i])}`` for the micro-batches this rank owns (:meth:`owns`), no grad."""
        with torch.no_grad():
            return {i: fn(model, mb) for i, mb in enumerate(batches) if self.owns(i)}

    def local(self, items: list[T]) -> list[T]:
        """This rank's share of a step's micro-batches: ``items[rank::world_size]``."""
        return items[self.rank :: self.world_size]

    def owns(self, index: int) -> bool:
        """Whether this rank computes item ``index`` of a list shared by all ranks."""
        return index % self.world_size == self.rank

    def attach(self, model: torch.nn.Module, loss_fn: LossFn) -> None:
        """Wrap ``model`` (already on its device) and ``loss_fn`` in DDP for a cycle's steps; DDP
        checks that every rank holds the same parameter shapes and broadcasts rank 0's values."""
        device = next(model.parameters()).device
        self._ddp = DistributedDataParallel(
            MicroBatchLoss(model, loss_fn),
            device_ids=[device.index] if device.type == "cuda" else None,
            forward_sync_buffers=False,  # buffers (rotary frequencies) are not trained: synced at init only
        )
        self._ddp.register_comm_hook(self, _sum_hook)
        self._prepared, self.reduced_buckets = False, 0

    def detach(self) -> None:
        """Drop the DDP wrapper and its gradient buckets (the model keeps its weights)."""
        self._ddp = None

    def loss(self, mb: Any, final: bool) -> tuple[torch.Tensor, dict[str, float]]:
        """``(loss, sums)`` of micro-batch ``mb`` through DDP's forward: under ``no_sync()`` unless
        ``final`` (this rank's last micro-batch of the step), so only the last one's backward
        all-reduces; the others' gradients accumulate locally (DDP decides at the forward)."""
        ddp = self._require_ddp()
        if not final:
            with ddp.no_sync():
                return ddp(mb, False)
        self._prepared, self._reduced_at_sync = True, self.reduced_buckets
        return ddp(mb, True)

    def finish_step(self) -> None:
        """After this rank's micro-batches of a step: if its gradients were not all-reduced (no
        micro-batch, or the last one's loss was not finite and skipped), backpropagate a zero that
        reaches every parameter, so they are: every rank takes part in each step's all-reduce."""
        ddp = self._require_ddp()
        if not self._prepared:
            zero, _ = ddp(None, True)
            zero.backward()
        elif self.reduced_buckets == self._reduced_at_sync:
            zero_reaching_every_parameter(ddp.module.policy).backward()
        self._prepared = False

    def _require_ddp(self) -> DistributedDataParallel:
        if self._ddp is None:
            raise RuntimeError("DataParallel.attach must wrap the model before its micro-batches run")
        return self._ddp

    def all_reduce_sums(self, values: dict[str, float], device: torch.device) -> dict[str, float]:
        """The sums over ranks of ``values`` (same keys on every rank), in float64."""
        keys = sorted(values)
        t = torch.tensor([float(values[k]) for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(t)
        return dict(zip(keys, t.tolist()))

    def share_old_logprobs(self, batches: list[Any]) -> None:
        """Give every rank ``mb.old_logprobs`` of every micro-batch, each broadcast from its owner
        (:meth:`owns`); the others allocate ``[N]`` fp32 on the micro-batch's device."""
        for i, mb in enumerate(batches):
            if not self.owns(i):
                mb.old_logprobs = torch.empty(mb.num_trainable, dtype=torch.float32, device=mb.targets.device)
            dist.broadcast(mb.old_logprobs, src=i % self.world_size)

    def send_work(self, work: CycleWork) -> None:
        """Rank 0: broadcast the cycle's work to the other ranks (they wait in :meth:`receive_work`)."""
        _broadcast_object(work)
        self._work_sent = True

    def release_followers(self) -> None:
        """Rank 0, at the end of a cycle: tell the other ranks there is nothing to train when no
        work was sent (skipped, locked, dry run, or an error before training)."""
        if not self._work_sent:
            _broadcast_object(None)
        self._work_sent = False

    def receive_work(self) -> CycleWork | None:
        """Other ranks: the cycle's work from rank 0, or None when rank 0 trains nothing."""
        return _broadcast_object(None)


def _broadcast_object(obj: Any) -> Any:
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def world_size_from_env() -> int:
    """``$WORLD_SIZE`` as set by torchrun (1 outside torchrun)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_data_parallel(device: torch.device, *, timeout_s: float = 1800.0) -> DataParallel | None:
    """Join the process group torchrun describes (``env://``: ``MASTER_ADDR``, ``MASTER_PORT``,
    ``RANK``, ``WORLD_SIZE``); None outside torchrun or with one rank.

    Args:
        device: this rank's training device: NCCL for CUDA, gloo for the CPU.
        timeout_s: longest wait in a collective (seconds); the ranks other than 0 wait in one
            between cycles, so a looping trainer passes more than its interval.

    Raises:
        ConfigurationError: ``RANK`` missing while ``WORLD_SIZE > 1``.
    """
    world = world_size_from_env()
    if world <= 1:
        return None
    if "RANK" not in os.environ:
        raise ConfigurationError("WORLD_SIZE > 1 but RANK is not set: start data-parallel training with torchrun")
    if device.type == "cuda":
        torch.cuda.set_device(device)  # NCCL's object collectives use the current device
    if not dist.is_initialized():
        backend = "nccl" if device.type == "cuda" else "gloo"
        device_id = device if device.type == "cuda" else None
        dist.init_process_group(
            backend, init_method="env://", timeout=timedelta(seconds=timeout_s), device_id=device_id
        )
    return DataParallel(dist.get_rank(), dist.get_world_size())


def shutdown_data_parallel() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()

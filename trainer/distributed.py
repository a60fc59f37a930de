"""Data-parallel training cycles with ``torch.distributed`` (``flywheel train`` under ``torchrun``).

Invariants:

- **Rank 0 alone touches the outside world.** It takes the trainer lock, selects the cycle's
  trajectories, and broadcasts them (with the parent checkpoint's directory) to the other ranks; it
  alone writes the checkpoint, manifest and delta and registers the candidate. The other ranks never
  open the database nor the checkpoint store's staging area. A rank killed at any point makes
  torchrun stop the group; rank 0 has then published nothing (the store publishes atomically) or a
  directory that the next cycle's sweep removes, exactly as a killed single-process cycle.
- **Same result as one process.** Every optimizer step's micro-batches are split across ranks
  (rank ``r`` takes ``group[r::world]``); each rank accumulates the gradients of its share, and the
  gradients are then *summed* over ranks (``all_reduce``): the loss is divided by a constant token
  count (Dr. GRPO), not by the number of micro-batches, so the sum over ranks is the single-process
  gradient up to floating-point summation order. Clipping and AdamW then run on identical
  gradients on every rank, so the replicas stay identical without a parameter broadcast.
- ``pi_old`` is computed once per micro-batch, by the rank ``i % world`` that owns it, and
  broadcast to the others.

Why not the ``DistributedDataParallel`` wrapper or FSDP2: the fused log-prob path
(:mod:`trainer.step`) runs the decoder and the LM head weight separately, not through the model's
``forward``, which is where DDP prepares its reducer and FSDP2's root all-gathers; and the last step
of an epoch may give a rank no micro-batch at all, which DDP's bucketed hooks cannot express. The
explicit bucketed ``all_reduce`` here is what DDP does for gradients, with those two cases handled.
Replicated weights bound the model to one GPU's memory (Qwen3-0.6B: ~10 GB of fp32 weights,
gradients and AdamW state); sharding the optimizer state is the next step past that size.

Backends: NCCL when the ranks train on CUDA, gloo on CPUs (the same code; tests run it).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from app.core.errors import ConfigurationError

T = TypeVar("T")
BUCKET_ELEMENTS = 1 << 24  # gradient elements per all_reduce (64 MB of fp32), DDP's order of magnitude


@dataclass(frozen=True)
class CycleWork:
    """What rank 0 broadcasts for one cycle: the parent's directory and the selected trajectories."""

    parent_dir: Path
    trajectories: list[Any]  # trainer.data.TrajectoryData


class DataParallel:
    """This process's place in an initialised default process group.

    Args:
        rank: this process's rank. world_size: the number of ranks.
    """

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self._work_sent = False

    @property
    def is_main(self) -> bool:
        """Whether this is rank 0 (the one that selects data, writes and registers)."""
        return self.rank == 0

    def local(self, items: list[T]) -> list[T]:
        """This rank's share of a step's micro-batches: ``items[rank::world_size]``."""
        return items[self.rank :: self.world_size]

    def owns(self, index: int) -> bool:
        """Whether this rank computes item ``index`` of a list shared by all ranks."""
        return index % self.world_size == self.rank

    def all_reduce_grads(self, model: torch.nn.Module) -> None:
        """Sum every trainable parameter's ``.grad`` over ranks, in place (a missing grad counts as 0:
        a rank may have had no micro-batch in the step). Buckets of :data:`BUCKET_ELEMENTS`."""
        params = [p for p in model.parameters() if p.requires_grad]
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        bucket: list[torch.Tensor] = []
        size = 0
        for p in params:
            bucket.append(p.grad)
            size += p.grad.numel()
            if size >= BUCKET_ELEMENTS:
                _all_reduce_bucket(bucket)
                bucket, size = [], 0
        if bucket:
            _all_reduce_bucket(bucket)

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


def _all_reduce_bucket(grads: list[torch.Tensor]) -> None:
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()


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
        kwargs = {"device_id": device} if device.type == "cuda" else {}
        dist.init_process_group(backend, init_method="env://", timeout=timedelta(seconds=timeout_s), **kwargs)
    return DataParallel(dist.get_rank(), dist.get_world_size())


def shutdown_data_parallel() -> None:
    """Leave the process group (no-op when none was joined)."""
    if dist.is_initialized():
        dist.destroy_process_group()


def run_parallel_cycle(
    config, dp: DataParallel, *, progress: bool = False, dry_run: bool = False, parent_id: str | None = None
):
    """One cycle on every rank of ``dp`` (see the module invariants); rank 0 returns what
    :func:`trainer.cycle.run_cycle` returns, the others a ``CycleResult`` naming their rank.

    Raises:
        As :func:`trainer.cycle.run_cycle` on rank 0; the other ranks raise what their training raises.
    """
    from trainer.cycle import CycleResult, run_cycle
    from trainer.training import train_policy

    if dp.is_main:
        try:
            return run_cycle(config, progress=progress, dry_run=dry_run, dp=dp, parent_id=parent_id)
        finally:
            dp.release_followers()
    work = dp.receive_work()
    if work is None:
        return CycleResult(status="skipped", detail=f"rank {dp.rank}/{dp.world_size}: rank 0 trained nothing")
    torch.set_num_threads(config.threads)
    trained = train_policy(config, work.parent_dir, work.trajectories, dp=dp)
    last = trained.history[-1] if trained.history else None
    return CycleResult(
        status="succeeded",
        detail=f"rank {dp.rank}/{dp.world_size}: trained with rank 0, which writes and registers the candidate",
        num_trajectories=len(work.trajectories),
        metrics={"steps": len(trained.history), "final_loss": last.loss if last else None},
    )

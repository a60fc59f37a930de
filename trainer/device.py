"""Where the policy runs and in which precision: the device placement policy of training and serving.

Invariant: one :class:`Placement` decides the device, the dtype of the weights, the dtype of the
compute and how batches reach the device, and nothing else in the trainer chooses them.

* **CPU** (``cpu``, or ``auto`` without a GPU): fp32 weights, fp32 compute, the chunked torch
  log-prob reference; exactly the arithmetic of a run without this module.
* **CUDA** (``cuda``, or ``auto`` with a GPU): fp32 *master* weights and fp32 AdamW state, bf16
  compute through ``torch.autocast`` (mixed precision as in Micikevicius et al. 2018, "Mixed
  Precision Training", with bf16 instead of fp16 so no loss scaling is needed); TF32 for the fp32
  matmuls that remain (gradient clipping, optimizer); the Triton log-prob kernel (``kernels/``),
  which :func:`kernels.chunked_logprobs` picks for CUDA tensors and runs in the autocast dtype;
  micro-batches copied from pinned host memory with ``non_blocking=True``. The checkpoint written
  is the fp32 master copy, as on the CPU. Under ``torchrun`` each process uses ``cuda:LOCAL_RANK``.

The serving engine takes the same ``device`` setting (:func:`app.inference.device.resolve_device`).
"""

from __future__ import annotations

import contextlib
import dataclasses
from dataclasses import dataclass
from typing import TypeVar

import torch

from app.inference.device import resolve_device

T = TypeVar("T")


@dataclass(frozen=True)
class Placement:
    """The resolved device and precision policy.

    Attributes:
        device: where weights, optimizer state and micro-batches live.
        param_dtype: dtype of the master weights and the optimizer state (always fp32).
        compute_dtype: dtype of autocast's matmuls (bf16 on CUDA, fp32 on the CPU: no autocast).
    """

    device: torch.device
    param_dtype: torch.dtype = torch.float32
    compute_dtype: torch.dtype = torch.float32

    @property
    def is_cuda(self) -> bool:
        """Whether the placement is a CUDA device."""
        return self.device.type == "cuda"

    def describe(self) -> dict[str, str]:
        """JSON-ready summary (for metrics and logs)."""
        return {
            "device": str(self.device),
            "param_dtype": str(self.param_dtype).removeprefix("torch."),
            "compute_dtype": str(self.compute_dtype).removeprefix("torch."),
        }

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for forward passes (a no-op on the CPU)."""
        if self.compute_dtype == self.param_dtype:
            return contextlib.nullcontext()
        return torch.autocast(self.device.type, dtype=self.compute_dtype)

    def place_model(self, model: torch.nn.Module) -> torch.nn.Module:
        """Move ``model`` to the device in ``param_dtype`` (in place; returns it)."""
        return model.to(device=self.device, dtype=self.param_dtype)

    def move_batch(self, batch: T) -> T:
        """A copy of a dataclass of tensors (e.g. :class:`trainer.batching.MicroBatch`) on the device.

        On CUDA each tensor is pinned and copied with ``non_blocking=True``; on the CPU the batch
        is returned as it is.
        """
        if not self.is_cuda:
            return batch
        moved = {}
        for f in dataclasses.fields(batch):
            value = getattr(batch, f.name)
            if isinstance(value, torch.Tensor):
                value = value.pin_memory().to(self.device, non_blocking=True)
            moved[f.name] = value
        return dataclasses.replace(batch, **moved)


def setup_placement(setting: str = "auto", local_rank: int | None = None) -> Placement:
    """Resolve ``setting`` (see :func:`resolve_device`) into a :class:`Placement` and configure torch
    for it: on CUDA select the device and allow TF32 matmuls (``torch.backends.cuda.matmul``) and
    convolutions.

    Raises:
        ConfigurationError: as :func:`resolve_device`.
    """
    device = resolve_device(setting, local_rank)
    if device.type != "cuda":
        return Placement(device=device)
    torch.cuda.set_device(device)
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    return Placement(device=device, compute_dtype=torch.bfloat16)

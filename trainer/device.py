"""Where the policy runs and in which precision: the device placement policy of training and serving.

Invariant: one :class:`Placement` decides the device, the dtype of the weights, the dtype of the
compute and how batches reach the device, and nothing else in the trainer chooses them. Weights and
AdamW state are fp32 on every device; only the compute dtype varies (``precision``).

* **Precision.** ``bf16``: forward passes (training and pi_old) run under ``torch.autocast`` in
  bf16 over fp32 *master* weights, the mixed precision of Micikevicius et al. 2018 ("Mixed
  Precision Training") with bf16 instead of fp16, so no loss scaling is needed; gradients reach
  the fp32 weights, AdamW updates them in fp32. ``fp32``: no autocast. ``auto``: bf16 on CUDA
  and on CPUs where it is measured faster (:func:`app.inference.precision.bf16_is_faster`: the CPU
  has ``amx_bf16`` or ``avx512_bf16`` and a probe of the model's matmuls found bf16 at least 1.1x
  faster than fp32), fp32 on other CPUs.
* **CPU**: the chunked torch log-prob path; the rest as the precision says.
* **CUDA** (``cuda``, or ``auto`` with a GPU): TF32 for the fp32 matmuls that remain (unless
  ``precision = "fp32"``); the Triton log-prob kernel (``kernels/``), which
  :func:`kernels.chunked_logprobs` picks for CUDA tensors; micro-batches copied from pinned host
  memory with ``non_blocking=True``. Under ``torchrun`` each process uses ``cuda:LOCAL_RANK``.

The checkpoint written is the fp32 master copy on every device. The serving engine takes the same
``device`` setting (:func:`app.inference.device.resolve_device`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

import torch

from app.core.cpu import BF16_CPU_FLAGS, cpu_has_bf16
from app.core.errors import ConfigurationError
from app.inference.device import resolve_device
from app.inference.precision import bf16_is_faster

if TYPE_CHECKING:
    from _typeshed import DataclassInstance

T = TypeVar("T", bound="DataclassInstance")
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Placement:
    """The resolved device and precision policy.

    Attributes:
        device: where weights, optimizer state and micro-batches live.
        param_dtype: dtype of the master weights and the optimizer state (always fp32).
        compute_dtype: dtype of autocast's matmuls (bf16), or fp32: no autocast.
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
            "precision": "bf16" if self.compute_dtype == torch.bfloat16 else "fp32",
        }

    def autocast(self) -> contextlib.AbstractContextManager:
        """Mixed-precision context for forward passes (a no-op in fp32)."""
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


PRECISIONS = ("auto", "bf16", "fp32")


def resolve_precision(setting: str, device: torch.device) -> torch.dtype:
    """The compute dtype ``setting`` names on ``device`` (see the module docstring).

    Raises:
        ConfigurationError: ``setting`` is not one of :data:`PRECISIONS`.
    """
    if setting not in PRECISIONS:
        raise ConfigurationError(f"unknown precision {setting!r}; expected one of {', '.join(PRECISIONS)}")
    if setting == "auto":
        faster = device.type == "cuda" or bf16_is_faster()
        return torch.bfloat16 if faster else torch.float32
    if setting == "bf16" and device.type == "cpu" and not cpu_has_bf16():
        log.warning("precision bf16 on a CPU without %s: bf16 is emulated, slower than fp32", "/".join(BF16_CPU_FLAGS))
    return torch.bfloat16 if setting == "bf16" else torch.float32


def setup_placement(setting: str = "auto", local_rank: int | None = None, precision: str = "auto") -> Placement:
    """Resolve ``setting`` (see :func:`resolve_device`) and ``precision`` (:func:`resolve_precision`)
    into a :class:`Placement` and configure torch for it: on CUDA select the device and, unless the
    compute is fp32, allow TF32 matmuls (``torch.backends.cuda.matmul``) and convolutions.

    Raises:
        ConfigurationError: as :func:`resolve_device` and :func:`resolve_precision`.
    """
    device = resolve_device(setting, local_rank)
    compute_dtype = resolve_precision(precision, device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
        if compute_dtype != torch.float32:
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
    return Placement(device=device, compute_dtype=compute_dtype)

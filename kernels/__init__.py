"""Triton kernels with torch reference fallbacks (used on CPU).

:func:`chunked_logprobs` is the entry point the trainer calls: the Triton kernel
(:mod:`kernels.logprobs`) on CUDA tensors, the chunked torch reference (:mod:`kernels.reference`)
elsewhere. Both return ``(logprobs [N], entropy [N])`` in fp32 without materializing ``[N, V]``
logits.
"""

from __future__ import annotations

from typing import Literal

import torch

from kernels.reference import DEFAULT_CHUNK_SIZE, chunked_logprobs_reference

Backend = Literal["auto", "torch", "triton"]


def chunked_logprobs(hidden, weight, targets, chunk_size: int | None = None, backend: Backend = "auto"):
    """Per-token log-probs of ``targets`` and next-token entropy, fused with the LM head.

    Args:
        hidden: ``[N, H]`` final hidden states. weight: ``[V, H]`` LM head. targets: ``[N]`` int ids.
        chunk_size: tokens per chunk (torch path) or vocabulary tile (Triton path); ``None`` picks
            the backend's default.
        backend: ``auto`` = Triton on CUDA tensors, torch otherwise; ``triton`` forces the kernel
            (on CPU only under ``TRITON_INTERPRET=1``, about 800x slower: tests only). Under
            ``torch.autocast`` the kernel reads hidden and weight in the autocast dtype (bf16 on
            CUDA; it accumulates in fp32) and gradients flow back to the fp32 master weight.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)`` in nats, differentiable w.r.t. hidden and weight.

    Raises:
        ValueError: unknown backend or inconsistent shapes.
    """
    if backend not in ("auto", "torch", "triton"):
        raise ValueError(f"unknown log-prob backend {backend!r}")
    if backend == "triton" or (backend == "auto" and hidden.is_cuda):
        # Triton fixes at a kernel's definition whether it runs interpreted (TRITON_INTERPRET, the
        # tests' CPU mode), and CPU training never launches it: the module loads at the first call.
        from kernels.logprobs import BLOCK_V, triton_logprobs

        if torch.is_autocast_enabled(hidden.device.type):  # the LM head in autocast's dtype, like nn.Linear
            dtype = torch.get_autocast_dtype(hidden.device.type)
            hidden, weight = hidden.to(dtype), weight.to(dtype)
        return triton_logprobs(hidden, weight, targets, chunk_size or BLOCK_V)
    return chunked_logprobs_reference(hidden, weight, targets, chunk_size or DEFAULT_CHUNK_SIZE)


__all__ = ["chunked_logprobs", "Backend"]

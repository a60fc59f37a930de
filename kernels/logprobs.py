"""Fused linear log-probs: per-token ``log p(target)`` and entropy from hidden states and the LM head.

One kernel, one file (after Liger-Kernel's ``ops/swiglu.py``): Triton kernels -> launchers ->
``torch.autograd.Function``. The torch reference with the same API lives in
:mod:`kernels.reference` (the CPU path, after apple ml-cross-entropy's ``linear_cross_entropy``).

Invariant: the ``[N, V]`` logits never exist in memory. Each program owns ``BLOCK_N`` tokens and
walks the vocabulary in ``BLOCK_V`` tiles, building each logit tile ``h @ W_tile^T`` in fp32
registers and folding it into an online log-sum-exp (Milakov & Gimelshein 2018, "Online normalizer
calculation for softmax"), carrying for every token the running max ``m``, ``s = sum exp(z - m)``,
``t = sum exp(z - m) z`` and the target logit. Then ``lse = m + log s``,
``logprob = z_y - lse`` and ``entropy = lse - t / s``.

Backward recomputes logit tiles from ``(hidden, weight, lse, entropy)`` (nothing ``[N, V]`` is
saved) and forms ``dz_j = g_lp (1[j = y] - p_j) + g_ent p_j (E_p[z] - z_j)``. Two kernels avoid
atomics and stay deterministic: one per token block accumulates ``dH = dz @ W``, one per vocab block
accumulates ``dW = dz^T @ H``; each recomputes its logit tiles (compute traded for memory, like
FlashAttention's backward).

Tests run these kernels under ``TRITON_INTERPRET=1`` on the CPU against an fp32 reference.

The tile helpers the three kernels share are in :mod:`kernels.tiles`.

Size: over 400 lines because the forward kernel, its two backward kernels, their launchers and the
autograd function are one kernel (STYLE.md 8), each backward read against the forward it inverts.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.reference import check_inputs
from kernels.tiles import add_dot_rows, grad_logits_tile, logits_tile, token_block

# Tile sizes. tl.dot needs every dimension >= 16. The GPU defaults suit H in the hundreds to
# thousands and V ~ 50k-150k; tests pass small blocks to exercise the masks on odd shapes.
BLOCK_N = 64
BLOCK_V = 128
BLOCK_H = 64


@triton.jit
def _logprobs_fwd_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    lp_ptr,
    ent_ptr,
    lse_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y = tl.load(y_ptr + offs_n, mask=mask_n, other=0)
    m = tl.full((BLOCK_N,), float("-inf"), dtype=tl.float32)
    s = tl.zeros((BLOCK_N,), dtype=tl.float32)
    t = tl.zeros((BLOCK_N,), dtype=tl.float32)
    z_y = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = logits_tile(
            h_ptr,
            w_ptr,
            offs_n,
            offs_v,
            mask_n,
            mask_v,
            H,
            stride_hn,
            stride_hh,
            stride_wv,
            stride_wh,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        z_masked = tl.where(mask_v[None, :], z, float("-inf"))
        m_new = tl.maximum(m, tl.max(z_masked, axis=1))
        scale = tl.exp(m - m_new)  # exp(-inf) = 0 on the first tile
        e = tl.exp(z_masked - m_new[:, None])
        s = s * scale + tl.sum(e, axis=1)
        t = t * scale + tl.sum(e * tl.where(mask_v[None, :], z, 0.0), axis=1)
        m = m_new
        z_y += tl.sum(tl.where(offs_v[None, :] == y[:, None], z, 0.0), axis=1)
    lse = m + tl.log(s)
    tl.store(lp_ptr + offs_n, z_y - lse, mask=mask_n)
    tl.store(ent_ptr + offs_n, lse - t / s, mask=mask_n)
    tl.store(lse_ptr + offs_n, lse, mask=mask_n)


@triton.jit
def _logprobs_bwd_dh_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dh_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_dn,
    stride_dh,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per token block: dH[n, :] = sum over vocab tiles of dz[n, v] @ W[v, :].
    pid = tl.program_id(0)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    y, lse, mean_logit, g_lp, g_ent = token_block(
        y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, offs_n, mask_n, HAS_GLP, HAS_GENT
    )
    for v0 in range(0, V, BLOCK_V):
        offs_v = v0 + tl.arange(0, BLOCK_V)
        mask_v = offs_v < V
        z = logits_tile(
            h_ptr,
            w_ptr,
            offs_n,
            offs_v,
            mask_n,
            mask_v,
            H,
            stride_hn,
            stride_hh,
            stride_wv,
            stride_wh,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        dz = grad_logits_tile(z, offs_v, mask_v, y, lse, mean_logit, g_lp, g_ent, HAS_GLP, HAS_GENT)
        dz = dz.to(w_ptr.dtype.element_ty)
        add_dot_rows(
            dh_ptr, offs_n, mask_n, stride_dn, stride_dh, dz, w_ptr, offs_v, mask_v, stride_wv, stride_wh, H, BLOCK_H
        )


@triton.jit
def _logprobs_bwd_dw_kernel(
    h_ptr,
    w_ptr,
    y_ptr,
    lse_ptr,
    ent_ptr,
    glp_ptr,
    gent_ptr,
    dw_ptr,
    N,
    V,
    H,
    stride_hn,
    stride_hh,
    stride_wv,
    stride_wh,
    stride_dv,
    stride_dh,
    HAS_GLP: tl.constexpr,
    HAS_GENT: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    # One program per vocab block: dW[v, :] = sum over token tiles of dz[n, v]^T @ H[n, :].
    pid = tl.program_id(0)
    offs_v = pid * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_v = offs_v < V
    for n0 in range(0, N, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < N
        y, lse, mean_logit, g_lp, g_ent = token_block(
            y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, offs_n, mask_n, HAS_GLP, HAS_GENT
        )
        z = logits_tile(
            h_ptr,
            w_ptr,
            offs_n,
            offs_v,
            mask_n,
            mask_v,
            H,
            stride_hn,
            stride_hh,
            stride_wv,
            stride_wh,
            BLOCK_N,
            BLOCK_V,
            BLOCK_H,
        )
        dz = grad_logits_tile(z, offs_v, mask_v, y, lse, mean_logit, g_lp, g_ent, HAS_GLP, HAS_GENT)
        dz = tl.where(mask_n[:, None], dz, 0.0).to(h_ptr.dtype.element_ty)
        add_dot_rows(
            dw_ptr,
            offs_v,
            mask_v,
            stride_dv,
            stride_dh,
            tl.trans(dz),
            h_ptr,
            offs_n,
            mask_n,
            stride_hn,
            stride_hh,
            H,
            BLOCK_H,
        )


def logprobs_forward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    block_n: int = BLOCK_N,
    block_v: int = BLOCK_V,
    block_h: int = BLOCK_H,
):
    """Launch the forward kernel.

    Args:
        hidden: ``[N, H]`` fp32/bf16/fp16. weight: ``[V, H]`` same dtype. targets: ``[N]`` int.

    Returns:
        ``(logprobs [N], entropy [N], lse [N])``, fp32, nats.
    """
    n, h = hidden.shape
    v = weight.shape[0]
    lp = torch.empty(n, dtype=torch.float32, device=hidden.device)
    ent = torch.empty_like(lp)
    lse = torch.empty_like(lp)
    grid = (triton.cdiv(n, block_n),)
    _logprobs_fwd_kernel[grid](
        hidden,
        weight,
        targets,
        lp,
        ent,
        lse,
        n,
        v,
        h,
        hidden.stride(0),
        hidden.stride(1),
        weight.stride(0),
        weight.stride(1),
        BLOCK_N=block_n,
        BLOCK_V=block_v,
        BLOCK_H=block_h,
    )
    return lp, ent, lse


def logprobs_backward(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    entropy: torch.Tensor,
    grad_logprobs: torch.Tensor | None,
    grad_entropy: torch.Tensor | None,
    *,
    need_hidden: bool = True,
    need_weight: bool = True,
    block_n: int = BLOCK_N,
    block_v: int = BLOCK_V,
    block_h: int = BLOCK_H,
):
    """Launch the backward kernels; returns ``(grad_hidden [N, H] | None, grad_weight [V, H] | None)``
    in the inputs' dtype (accumulated in fp32)."""
    n, h = hidden.shape
    v = weight.shape[0]
    has_glp, has_gent = grad_logprobs is not None, grad_entropy is not None
    dummy = torch.zeros(1, dtype=torch.float32, device=hidden.device)
    glp = grad_logprobs.float().contiguous() if grad_logprobs is not None else dummy
    gent = grad_entropy.float().contiguous() if grad_entropy is not None else dummy
    common = dict(HAS_GLP=has_glp, HAS_GENT=has_gent, BLOCK_N=block_n, BLOCK_V=block_v, BLOCK_H=block_h)
    strides = (hidden.stride(0), hidden.stride(1), weight.stride(0), weight.stride(1))
    grad_hidden = grad_weight = None
    if need_hidden:
        dh = torch.zeros((n, h), dtype=torch.float32, device=hidden.device)
        _logprobs_bwd_dh_kernel[(triton.cdiv(n, block_n),)](
            hidden,
            weight,
            targets,
            lse,
            entropy,
            glp,
            gent,
            dh,
            n,
            v,
            h,
            *strides,
            dh.stride(0),
            dh.stride(1),
            **common,
        )
        grad_hidden = dh.to(hidden.dtype)
    if need_weight:
        dw = torch.zeros((v, h), dtype=torch.float32, device=hidden.device)
        _logprobs_bwd_dw_kernel[(triton.cdiv(v, block_v),)](
            hidden,
            weight,
            targets,
            lse,
            entropy,
            glp,
            gent,
            dw,
            n,
            v,
            h,
            *strides,
            dw.stride(0),
            dw.stride(1),
            **common,
        )
        grad_weight = dw.to(weight.dtype)
    return grad_hidden, grad_weight


class LogProbsFunction(torch.autograd.Function):
    """Autograd wrapper: saves ``(hidden, weight, targets, lse, entropy)``, never logits."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, block_n, block_v, block_h):
        lp, ent, lse = logprobs_forward(hidden, weight, targets, block_n=block_n, block_v=block_v, block_h=block_h)
        ctx.save_for_backward(hidden, weight, targets, lse, ent)
        ctx.blocks = (block_n, block_v, block_h)
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx, grad_logprobs, grad_entropy):
        hidden, weight, targets, lse, ent = ctx.saved_tensors
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None, None, None
        block_n, block_v, block_h = ctx.blocks
        gh, gw = logprobs_backward(
            hidden,
            weight,
            targets,
            lse,
            ent,
            grad_logprobs,
            grad_entropy,
            need_hidden=ctx.needs_input_grad[0],
            need_weight=ctx.needs_input_grad[1],
            block_n=block_n,
            block_v=block_v,
            block_h=block_h,
        )
        return gh, gw, None, None, None, None


def triton_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    chunk_size: int = BLOCK_V,
    *,
    block_n: int = BLOCK_N,
    block_h: int = BLOCK_H,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropy, fused with the LM head (Triton).

    Same API as :func:`kernels.reference.chunked_logprobs_reference`; here ``chunk_size`` is the
    vocabulary tile (``BLOCK_V``, a power of two >= 16).

    Args:
        hidden: ``[N, H]`` float. weight: ``[V, H]`` same dtype. targets: ``[N]`` int ids in ``[0, V)``.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)``, nats, differentiable w.r.t. hidden and weight.

    Raises:
        ValueError: inconsistent shapes or block sizes.
    """
    check_inputs(hidden, weight, targets)
    for name, b in (("chunk_size", chunk_size), ("block_n", block_n), ("block_h", block_h)):
        if b < 16 or b & (b - 1):
            raise ValueError(f"{name} must be a power of two >= 16, got {b}")
    if hidden.dtype != weight.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}")
    return LogProbsFunction.apply(hidden, weight, targets.long().contiguous(), block_n, chunk_size, block_h)

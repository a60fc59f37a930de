"""Triton tile helpers of the fused log-prob kernels (:mod:`kernels.logprobs`): strided tile loads, a
logit tile built in fp32 registers, the logits' gradient tile, a token block's saved values, and
the row update ``out += dz @ src`` that needs no atomics.

Each is ``@triton.jit`` and is inlined into the kernel that calls it; shapes are Triton block
shapes (``BLOCK_N`` tokens, ``BLOCK_V`` vocabulary entries, ``BLOCK_H`` hidden units).
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def load_tile(ptr, offs_r, offs_c, mask_r, mask_c, stride_r, stride_c):
    """The ``[R, C]`` tile ``ptr[offs_r, offs_c]`` of a strided matrix (zeros outside the masks)."""
    return tl.load(
        ptr + offs_r[:, None] * stride_r + offs_c[None, :] * stride_c,
        mask=mask_r[:, None] & mask_c[None, :],
        other=0.0,
    )


@triton.jit
def logits_tile(
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
    BLOCK_N: tl.constexpr,
    BLOCK_V: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """fp32 ``[BLOCK_N, BLOCK_V]`` tile of ``hidden @ weight^T`` (zeros outside the masks)."""
    acc = tl.zeros((BLOCK_N, BLOCK_V), dtype=tl.float32)
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        a = load_tile(h_ptr, offs_n, offs_h, mask_n, mask_h, stride_hn, stride_hh)
        b = load_tile(w_ptr, offs_v, offs_h, mask_v, mask_h, stride_wv, stride_wh)
        acc = tl.dot(a, tl.trans(b), acc, input_precision="ieee")
    return acc


@triton.jit
def grad_logits_tile(z, offs_v, mask_v, y, lse, mean_logit, g_lp, g_ent, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr):
    """``dz = g_lp (1[j = y] - p) + g_ent p (E_p[z] - z)``, zero outside the vocabulary."""
    p = tl.exp(z - lse[:, None])
    p = tl.where(mask_v[None, :], p, 0.0)
    dz = tl.zeros(z.shape, dtype=tl.float32)
    if HAS_GLP:
        onehot = (offs_v[None, :] == y[:, None]).to(tl.float32)
        dz += g_lp[:, None] * (onehot - p)
    if HAS_GENT:
        dz += g_ent[:, None] * p * tl.where(mask_v[None, :], mean_logit[:, None] - z, 0.0)
    return dz


@triton.jit
def token_block(
    y_ptr, lse_ptr, ent_ptr, glp_ptr, gent_ptr, offs_n, mask_n, HAS_GLP: tl.constexpr, HAS_GENT: tl.constexpr
):
    """What the backward kernels read of a token block: ``(targets, lse, E_p[z] = lse - entropy,
    g_lp, g_ent)``, the last two the upstream gradients of the two outputs (zeros for an absent one)."""
    y = tl.load(y_ptr + offs_n, mask=mask_n, other=0)
    lse = tl.load(lse_ptr + offs_n, mask=mask_n, other=0.0)
    mean_logit = lse - tl.load(ent_ptr + offs_n, mask=mask_n, other=0.0)
    g_lp = tl.zeros(offs_n.shape, dtype=tl.float32)
    g_ent = tl.zeros(offs_n.shape, dtype=tl.float32)
    if HAS_GLP:
        g_lp = tl.load(glp_ptr + offs_n, mask=mask_n, other=0.0)
    if HAS_GENT:
        g_ent = tl.load(gent_ptr + offs_n, mask=mask_n, other=0.0)
    return y, lse, mean_logit, g_lp, g_ent


@triton.jit
def add_dot_rows(
    out_ptr,
    offs_r,
    mask_r,
    stride_or,
    stride_oh,
    dz,
    src_ptr,
    offs_k,
    mask_k,
    stride_sk,
    stride_sh,
    H,
    BLOCK_H: tl.constexpr,
):
    """``out[offs_r, :] += dz @ src[offs_k, :]`` for ``dz`` ``[R, K]``, over ``H`` columns in
    ``BLOCK_H`` tiles, into fp32 ``out``. The calling program alone owns these rows of ``out``, so the
    read-modify-write needs no atomics."""
    for h0 in range(0, H, BLOCK_H):
        offs_h = h0 + tl.arange(0, BLOCK_H)
        mask_h = offs_h < H
        src = load_tile(src_ptr, offs_k, offs_h, mask_k, mask_h, stride_sk, stride_sh)
        ptrs = out_ptr + offs_r[:, None] * stride_or + offs_h[None, :] * stride_oh
        mask = mask_r[:, None] & mask_h[None, :]
        acc = tl.load(ptrs, mask=mask, other=0.0)
        acc = tl.dot(dz, src, acc, input_precision="ieee")
        tl.store(ptrs, acc, mask=mask)

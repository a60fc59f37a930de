"""A per-token loss on log-probs fused with the LM head: gradients computed during the forward pass.

When the loss is a sum of per-token terms ``loss = sum_t f_t(logprob_t)`` (true of the policy loss:
every factor -- ratio, clip, importance weight, KL estimate -- is elementwise), the gradient of a
token's logit row needs only that token's ``df_t/dlogprob_t``. So each vocabulary chunk of logits
can be turned into its gradients while it is still in memory, the way Liger-Kernel's fused linear
cross entropy does: per token chunk, one matmul for the logits, one for ``dH``, one accumulating
``dW`` -- three instead of the four of forward + recomputing backward
(:mod:`kernels.reference`), and still never more than ``chunk_size x V`` logits at once.

Invariant: :func:`chunked_logprob_loss` returns the same loss value and the same gradients w.r.t.
hidden and weight as ``token_loss`` applied to :func:`kernels.chunked_logprobs` (tests check it).
The backward pass only scales the stored gradients by the upstream gradient of the scalar loss.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kernels import chunked_logprobs
from kernels.reference import (
    DEFAULT_CHUNK_SIZE,
    check_inputs,
    chunk_backward,
    chunk_buffers,
    chunk_forward,
    grad_buffers,
)

TokenLoss = Callable[[torch.Tensor, slice], torch.Tensor]
"""``token_loss(logprobs_chunk [n] fp32 requiring grad, token_slice) -> scalar`` contribution of the
tokens ``token_slice`` to the loss; must depend on each token's log-prob only elementwise."""


class _FusedLogProbLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, targets, token_loss: TokenLoss, chunk_size: int):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty_like(logprobs)
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden, grad_weight = grad_buffers(hidden, weight, need_h, need_w)
        x_buf, e_buf = chunk_buffers(min(chunk_size, n), weight.shape[0], hidden.device)
        for s in range(0, n, chunk_size):
            e = min(s + chunk_size, n)
            h, y = hidden[s:e], targets[s:e]
            _, lp, ent, total, _, ex = chunk_forward(h, weight, y, x_buf, e_buf)
            lp = lp.detach()
            logprobs[s:e], entropy[s:e] = lp, ent
            with torch.enable_grad():
                leaf = lp.clone().requires_grad_()
                chunk_loss = token_loss(leaf, slice(s, e))
                (g,) = torch.autograd.grad(chunk_loss, leaf, allow_unused=True)
            loss += chunk_loss.detach().float()
            if g is None or not (need_h or need_w):
                continue
            g = g.float()
            # d loss / d z_j = g (1[j = y] - p_j), with p = e / sum(e): one in-place pass
            grad_logits = ex.mul_((-g / total)[:, None])
            grad_logits.scatter_add_(1, y[:, None], g[:, None])
            chunk_backward(grad_logits, h, weight, grad_hidden[s:e] if grad_hidden is not None else None, grad_weight)
        del x_buf, e_buf
        ctx.save_for_backward(grad_hidden, grad_weight.to(weight.dtype) if grad_weight is not None else None)
        ctx.mark_non_differentiable(logprobs, entropy)
        return loss, logprobs, entropy

    @staticmethod
    def backward(ctx, grad_loss, _grad_lp, _grad_ent):
        grad_hidden, grad_weight = ctx.saved_tensors
        if grad_hidden is not None:
            grad_hidden = grad_hidden * grad_loss.to(grad_hidden.dtype)
        if grad_weight is not None:
            grad_weight = grad_weight * grad_loss.to(grad_weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def chunked_logprob_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    token_loss: TokenLoss,
    chunk_size: int = DEFAULT_CHUNK_SIZE,
    backend: str = "auto",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_loss`` of the targets' log-probs, fused with the LM head (gradients in the forward pass).

    Args:
        hidden: ``[N, H]`` final hidden states. weight: ``[V, H]`` LM head. targets: ``[N]`` int ids.
        token_loss: see :data:`TokenLoss`; called once per token chunk with that chunk's log-probs.
        chunk_size: tokens per chunk (peak extra memory about ``2 x chunk_size x V x 4`` bytes).
        backend: ``torch`` fuses as described; ``triton`` / ``auto`` on CUDA use the Triton kernel
            with autograd (two passes over the vocabulary, no fusion needed on a GPU).

    Returns:
        ``(loss [] differentiable w.r.t. hidden and weight, logprobs [N] fp32, entropy [N] fp32)``;
        log-probs and entropies are detached.
    """
    check_inputs(hidden, weight, targets)
    if backend == "triton" or (backend == "auto" and hidden.is_cuda):
        lp, ent = chunked_logprobs(hidden, weight, targets, None, backend="triton")
        return token_loss(lp, slice(0, hidden.shape[0])), lp.detach(), ent.detach()
    return _FusedLogProbLoss.apply(hidden, weight, targets.long(), token_loss, int(chunk_size))

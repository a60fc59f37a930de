"""Chunked per-token log-probs and entropy in plain torch: the CPU path and the kernels' reference.

Invariant: the full ``[N, V]`` logits are never held at once. Forward and backward both walk the
tokens in chunks of ``chunk_size`` rows; the backward recomputes each chunk's logits from the saved
inputs and its log-sum-exp instead of keeping them (activation recomputation, as in apple's
ml-cross-entropy torch path), so peak extra memory is ``O(chunk_size x V)`` rather than ``O(N x V)``.

Math for one token with logits ``z = W h`` (``[V]``), target ``y``, ``p = softmax(z)``:

* ``logprob = z_y - logsumexp(z)``
* ``entropy = logsumexp(z) - sum_j p_j z_j``
* ``d logprob / d z_j = 1[j = y] - p_j``
* ``d entropy / d z_j = p_j (E_p[z] - z_j)``  with ``E_p[z] = logsumexp(z) - entropy``
"""

from __future__ import annotations

import torch

DEFAULT_CHUNK_SIZE = 1024


def _check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(f"expected hidden [N, H], weight [V, H], targets [N]; got "
                         f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}")
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
                         f"targets {tuple(targets.shape)}")


def _chunk_stats(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor):
    """(logsumexp, target logit, E_p[z]) of one chunk, computed in fp32.

    Shapes: ``h`` [n, H], ``weight`` [V, H], ``y`` [n] -> three [n] fp32 tensors. Holds at most two
    ``[n, V]`` fp32 buffers at a time.
    """
    logits = (h @ weight.t()).float()
    lse = torch.logsumexp(logits, dim=-1)
    target = logits.gather(1, y[:, None]).squeeze(1)
    weighted = logits.sub(lse[:, None]).exp_().mul_(logits)  # p_j z_j
    mean_logit = weighted.sum(-1)
    return lse, target, mean_logit


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function: forward in token chunks, backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        with torch.no_grad():
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                lse, target, mean_logit = _chunk_stats(hidden[s:e], weight, targets[s:e])
                logprobs[s:e] = target - lse
                entropy[s:e] = lse - mean_logit
                lse_all[s:e] = lse
        ctx.save_for_backward(hidden, weight, targets, lse_all, entropy)
        ctx.chunk_size = chunk_size
        ctx.set_materialize_grads(False)  # an unused output (often entropy) then costs nothing
        return logprobs, entropy

    @staticmethod
    def backward(ctx, grad_logprobs: torch.Tensor | None, grad_entropy: torch.Tensor | None):
        hidden, weight, targets, lse_all, entropy = ctx.saved_tensors
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        if grad_logprobs is None and grad_entropy is None:
            return None, None, None, None
        grad_hidden = torch.empty_like(hidden) if need_h else None
        grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_w else None
        n = hidden.shape[0]
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h, y = hidden[s:e], targets[s:e]
            logits = (h @ weight.t()).float()
            probs = logits.sub(lse_all[s:e, None]).exp_()
            if grad_entropy is not None:
                mean_logit = lse_all[s:e] - entropy[s:e]
                # d entropy / d z_j = p_j (E_p[z] - z_j)
                grad_logits = logits.neg_().add_(mean_logit[:, None]).mul_(probs)
                grad_logits.mul_(grad_entropy[s:e, None].float())
                if grad_logprobs is not None:
                    # d logprob / d z_j = 1[j = y] - p_j
                    grad_logits.addcmul_(probs, grad_logprobs[s:e, None].float(), value=-1.0)
            else:
                del logits
                grad_logits = probs.mul_(-grad_logprobs[s:e, None].float())
            if grad_logprobs is not None:
                grad_logits.scatter_add_(1, y[:, None], grad_logprobs[s:e, None].float())
            del probs
            grad_logits = grad_logits.to(weight.dtype)
            if need_h:
                torch.mm(grad_logits, weight, out=grad_hidden[s:e])
            if need_w:
                if grad_weight.dtype == grad_logits.dtype:
                    grad_weight.addmm_(grad_logits.t(), h)  # no [V, H] temporary per chunk
                else:
                    grad_weight.add_((grad_logits.t() @ h).float())
            del grad_logits
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def chunked_logprobs_reference(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor,
                               chunk_size: int = DEFAULT_CHUNK_SIZE) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropy of the next-token distribution, chunked.

    Args:
        hidden: ``[N, H]`` final hidden states (any float dtype; logits are computed in fp32).
        weight: ``[V, H]`` LM head weight (same dtype as ``hidden``).
        targets: ``[N]`` int64 token ids in ``[0, V)``.
        chunk_size: tokens per chunk; peak extra memory is about ``3 x chunk_size x V x 4`` bytes.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)`` in nats; both differentiable w.r.t. ``hidden``
        and ``weight``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    _check_inputs(hidden, weight, targets)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLogProbs.apply(hidden, weight, targets.long(), int(chunk_size))


def naive_logprobs(hidden: torch.Tensor, weight: torch.Tensor,
                   targets: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The textbook path, ``log_softmax(hidden @ weight.T).gather(targets)``, materializing ``[N, V]``.

    Same API and outputs as :func:`chunked_logprobs_reference`; the ground truth in tests and the
    baseline in ``bench/logprob.py``.
    """
    _check_inputs(hidden, weight, targets)
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    lp = logp.gather(1, targets.long()[:, None]).squeeze(1)
    entropy = -(logp.exp() * logp).sum(-1)
    return lp, entropy

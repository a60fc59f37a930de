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


def check_inputs(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor) -> None:
    """Check the shapes every log-prob path takes: hidden ``[N, H]``, weight ``[V, H]``, targets ``[N]``.

    Raises:
        ValueError: a tensor of the wrong rank, or ``N`` or ``H`` not matching.
    """
    if hidden.dim() != 2 or weight.dim() != 2 or targets.dim() != 1:
        raise ValueError(
            f"expected hidden [N, H], weight [V, H], targets [N]; got "
            f"{tuple(hidden.shape)}, {tuple(weight.shape)}, {tuple(targets.shape)}"
        )
    if hidden.shape[1] != weight.shape[1] or hidden.shape[0] != targets.shape[0]:
        raise ValueError(
            f"shape mismatch: hidden {tuple(hidden.shape)}, weight {tuple(weight.shape)}, "
            f"targets {tuple(targets.shape)}"
        )


def chunk_buffers(rows: int, vocab: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two ``[rows, V]`` fp32 buffers reused by every chunk (fresh large allocations would
    page-fault and zero hundreds of MB per chunk)."""
    x = torch.empty((rows, vocab), dtype=torch.float32, device=device)
    return x, torch.empty_like(x)


def chunk_forward(h: torch.Tensor, weight: torch.Tensor, y: torch.Tensor, x_buf: torch.Tensor, e_buf: torch.Tensor):
    """Statistics of one token chunk, computed in the given buffers.

    Shapes: ``h`` [n, H], ``weight`` [V, H], ``y`` [n]; buffers at least ``[n, V]`` fp32.

    Returns:
        ``(lse [n], logprob [n], entropy [n], total [n], x, ex)`` where ``x = z - max(z)`` and
        ``ex = exp(x)`` are views of the buffers and ``total = sum(ex)``, so ``p = ex / total``.
    """
    n = h.shape[0]
    x = x_buf[:n]
    if h.dtype == torch.float32 and weight.dtype == torch.float32:
        torch.mm(h, weight.t(), out=x)
    else:
        x.copy_(h @ weight.t())
    m = x.amax(dim=-1)
    target = x.gather(1, y[:, None]).squeeze(1)
    x.sub_(m[:, None])
    ex = torch.exp(x, out=e_buf[:n])
    total = ex.sum(-1)
    log_total = total.log()
    # entropy = lse - E_p[z] = log(sum e) - sum(e x) / sum(e); a batched dot product, no temporary
    entropy = log_total - torch.bmm(ex.unsqueeze(1), x.unsqueeze(2)).view(-1) / total
    return m + log_total, target - m - log_total, entropy, total, x, ex


def grad_buffers(
    hidden: torch.Tensor, weight: torch.Tensor, need_hidden: bool, need_weight: bool
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """``(grad_hidden [N, H] uninitialised in hidden's dtype, grad_weight [V, H] fp32 zeros)`` that
    :func:`chunk_backward` fills chunk by chunk; None for a gradient not needed."""
    grad_hidden = torch.empty_like(hidden) if need_hidden else None
    grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if need_weight else None
    return grad_hidden, grad_weight


def chunk_backward(
    grad_logits: torch.Tensor,
    h: torch.Tensor,
    weight: torch.Tensor,
    grad_hidden: torch.Tensor | None,
    grad_weight: torch.Tensor | None,
) -> None:
    """Backpropagate one chunk's ``grad_logits`` ``[n, V]`` fp32 through ``logits = h @ weight^T``.

    Writes ``grad_logits @ weight`` into ``grad_hidden`` (the chunk's ``[n, H]`` rows) and adds
    ``grad_logits^T @ h`` to the fp32 accumulator ``grad_weight`` ``[V, H]``; a None target is skipped.
    Both matmuls run in ``weight``'s dtype.
    """
    grad_logits = grad_logits.to(weight.dtype)
    if grad_hidden is not None:
        torch.mm(grad_logits, weight, out=grad_hidden)
    if grad_weight is not None:
        if grad_weight.dtype == grad_logits.dtype:
            grad_weight.addmm_(grad_logits.t(), h)  # no [V, H] temporary per chunk
        else:
            grad_weight.add_((grad_logits.t() @ h).float())


class _ChunkedLogProbs(torch.autograd.Function):
    """Autograd function: forward in token chunks, backward recomputes each chunk's logits."""

    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int):
        n = hidden.shape[0]
        logprobs = torch.empty(n, dtype=torch.float32, device=hidden.device)
        entropy = torch.empty(n, dtype=torch.float32, device=hidden.device)
        lse_all = torch.empty(n, dtype=torch.float32, device=hidden.device)
        x_buf, e_buf = chunk_buffers(min(chunk_size, n), weight.shape[0], hidden.device)
        with torch.no_grad():
            for s in range(0, n, chunk_size):
                e = min(s + chunk_size, n)
                lse, lp, ent, _, _, _ = chunk_forward(hidden[s:e], weight, targets[s:e], x_buf, e_buf)
                logprobs[s:e], entropy[s:e], lse_all[s:e] = lp, ent, lse
        del x_buf, e_buf
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
        grad_hidden, grad_weight = grad_buffers(hidden, weight, need_h, need_w)
        n = hidden.shape[0]
        x_buf, e_buf = chunk_buffers(min(ctx.chunk_size, n), weight.shape[0], hidden.device)
        for s in range(0, n, ctx.chunk_size):
            e = min(s + ctx.chunk_size, n)
            h, y = hidden[s:e], targets[s:e]
            # recompute: x = z - max, ex = exp(x), p = ex / total
            _, _, _, total, x, ex = chunk_forward(h, weight, y, x_buf, e_buf)
            probs = ex.div_(total[:, None])
            if grad_entropy is not None:
                # d entropy / d z_j = p_j (E_p[z] - z_j) = p_j (E_p[x] - x_j)
                mean_x = torch.bmm(probs.unsqueeze(1), x.unsqueeze(2)).view(-1)
                grad_logits = x.neg_().add_(mean_x[:, None]).mul_(probs).mul_(grad_entropy[s:e, None].float())
                if grad_logprobs is not None:
                    # d logprob / d z_j = 1[j = y] - p_j
                    grad_logits.addcmul_(probs, grad_logprobs[s:e, None].float(), value=-1.0)
            else:
                assert grad_logprobs is not None  # one of the two is set (the early return above)
                grad_logits = probs.mul_(-grad_logprobs[s:e, None].float())
            if grad_logprobs is not None:
                grad_logits.scatter_add_(1, y[:, None], grad_logprobs[s:e, None].float())
            chunk_backward(grad_logits, h, weight, grad_hidden[s:e] if grad_hidden is not None else None, grad_weight)
        del x_buf, e_buf
        if grad_weight is not None:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def chunked_logprobs_reference(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_size: int = DEFAULT_CHUNK_SIZE
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-token log-probs of ``targets`` and entropy of the next-token distribution, chunked.

    Args:
        hidden: ``[N, H]`` final hidden states (any float dtype; logits are computed in fp32).
        weight: ``[V, H]`` LM head weight (same dtype as ``hidden``).
        targets: ``[N]`` int64 token ids in ``[0, V)``.
        chunk_size: tokens per chunk; peak extra memory is about ``2 x chunk_size x V x 4`` bytes.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)`` in nats; both differentiable w.r.t. ``hidden``
        and ``weight``.

    Raises:
        ValueError: inconsistent shapes or a non-positive ``chunk_size``.
    """
    check_inputs(hidden, weight, targets)
    if chunk_size <= 0:
        raise ValueError(f"chunk_size must be positive, got {chunk_size}")
    return _ChunkedLogProbs.apply(hidden, weight, targets.long(), int(chunk_size))


def naive_logprobs(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, *, entropy: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The textbook path, ``log_softmax(hidden @ weight.T).gather(targets)``, materializing ``[N, V]``.

    Same API and outputs as :func:`chunked_logprobs_reference`; the ground truth in tests and the
    baseline in ``bench/logprob.py``, which passes ``entropy=False``: the entropy is then None and its
    ``[N, V]`` temporaries are never formed.
    """
    check_inputs(hidden, weight, targets)
    logp = torch.log_softmax((hidden @ weight.t()).float(), dim=-1)
    lp = logp.gather(1, targets.long()[:, None]).squeeze(1)
    return lp, -(logp.exp() * logp).sum(-1) if entropy else None

"""The fused log-prob kernel and the chunked torch path against an fp64 ground truth: values and
gradients, odd shapes, either output unused. The kernel runs compiled on CUDA tensors where a GPU
exists and under the Triton interpreter on CPU tensors otherwise.

Error bounds follow apple ml-cross-entropy's tests: the fp32 implementations must stay within a
small multiple of the fp32 naive path's own error against fp64.
"""

from __future__ import annotations

import os

import pytest
import torch

ON_GPU = torch.cuda.is_available()
# Without a GPU the kernel runs under the Triton interpreter: tests/fixtures/environment.py sets
# TRITON_INTERPRET before anything imports triton (importing it first decides interpreted or not).
assert ON_GPU or os.environ.get("TRITON_INTERPRET") == "1", "run through pytest: tests/fixtures/environment.py"

from kernels import chunked_logprobs  # noqa: E402
from kernels.reference import chunked_logprobs_reference, naive_logprobs  # noqa: E402

SHAPES = [(37, 101, 45), (16, 64, 32), (5, 259, 17), (1, 33, 16)]  # (N, V, H), mostly not block multiples


def _inputs(n, v, h, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, h, generator=g, dtype=torch.float64)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64) * 0.5
    targets = torch.randint(0, v, (n,), generator=g)
    g_lp = torch.randn(n, generator=g, dtype=torch.float64)
    g_ent = torch.randn(n, generator=g, dtype=torch.float64)
    return hidden, weight, targets, g_lp, g_ent


def _run(fn, hidden, weight, targets, g_lp, g_ent, dtype, use=("lp", "ent")):
    h = hidden.to(dtype).detach().requires_grad_()
    w = weight.to(dtype).detach().requires_grad_()
    lp, ent = fn(h, w, targets)
    loss = torch.zeros((), dtype=torch.float64)
    if "lp" in use:
        loss = loss + (lp.double() * g_lp).sum()
    if "ent" in use:
        loss = loss + (ent.double() * g_ent).sum()
    loss.backward()
    return [lp.detach().double(), ent.detach().double(), h.grad.double(), w.grad.double()]


def _triton(block_v=32):
    def fn(h, w, y):
        if not ON_GPU:
            return chunked_logprobs(h, w, y, chunk_size=block_v, backend="triton")
        lp, ent = chunked_logprobs(h.cuda(), w.cuda(), y.cuda(), chunk_size=block_v, backend="triton")
        return lp.cpu(), ent.cpu()

    return fn


def _torch_chunked(chunk=8):
    def fn(h, w, y):
        return chunked_logprobs_reference(h, w, y, chunk_size=chunk)

    return fn


def _assert_close_to_truth(candidate, baseline, truth, names=("logprobs", "entropy", "grad_hidden", "grad_weight")):
    for name, c, b, t in zip(names, candidate, baseline, truth):
        err = (c - t).abs().max().item()
        own = (b - t).abs().max().item()
        bound = max(8 * own, 1e-5 * max(1.0, t.abs().max().item()))
        assert err <= bound, f"{name}: error {err:.3g} > bound {bound:.3g} (fp32 naive error {own:.3g})"


@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_values_and_gradients_match_fp64(shape, impl):
    args = _inputs(*shape)
    truth = _run(naive_logprobs, *args, dtype=torch.float64)
    naive32 = _run(naive_logprobs, *args, dtype=torch.float32)
    fn = _triton() if impl == "triton" else _torch_chunked()
    _assert_close_to_truth(_run(fn, *args, dtype=torch.float32), naive32, truth)


@pytest.mark.parametrize("use", [("lp",), ("ent",)])
@pytest.mark.parametrize("impl", ["triton", "torch"])
def test_one_output_unused(use, impl):
    args = _inputs(23, 70, 20, seed=1)
    truth = _run(naive_logprobs, *args, dtype=torch.float64, use=use)
    naive32 = _run(naive_logprobs, *args, dtype=torch.float32, use=use)
    fn = _triton() if impl == "triton" else _torch_chunked(5)
    _assert_close_to_truth(_run(fn, *args, dtype=torch.float32, use=use), naive32, truth)


def test_logprobs_are_normalized_and_entropy_bounded():
    # Summing exp(logprob) over every possible target gives 1; entropy lies in [0, log V].
    n, v, h = 3, 50, 16
    hidden, weight, _, _, _ = _inputs(n, v, h, seed=2)
    hidden = hidden.float().repeat_interleave(v, 0)
    targets = torch.arange(v).repeat(n)
    for fn in (_triton(16), _torch_chunked(7)):
        lp, ent = fn(hidden, weight.float(), targets)
        total = lp.exp().view(n, v).sum(-1)
        torch.testing.assert_close(total, torch.ones(n), atol=1e-5, rtol=0)
        assert ((ent >= -1e-5) & (ent <= torch.log(torch.tensor(float(v))) + 1e-5)).all()


def test_extreme_logits_stay_finite():
    # Large logits overflow a non-online softmax; the online log-sum-exp must not.
    hidden, weight, targets, g_lp, g_ent = _inputs(9, 40, 16, seed=3)
    hidden = hidden * 40.0
    for fn in (_triton(16), _torch_chunked(4)):
        out = _run(fn, hidden, weight, targets, g_lp, g_ent, dtype=torch.float32)
        assert all(torch.isfinite(t).all() for t in out)
    truth = _run(naive_logprobs, hidden, weight, targets, g_lp, g_ent, dtype=torch.float64)
    tri = _run(_triton(16), hidden, weight, targets, g_lp, g_ent, dtype=torch.float32)
    torch.testing.assert_close(tri[0], truth[0], atol=1e-3, rtol=1e-4)


def test_rejects_bad_shapes_and_blocks():
    hidden, weight, targets, _, _ = _inputs(4, 20, 16)
    with pytest.raises(ValueError):
        chunked_logprobs(hidden.float(), weight.float()[:, :8], targets)
    with pytest.raises(ValueError):
        chunked_logprobs(hidden.float(), weight.float(), targets, chunk_size=24, backend="triton")
    with pytest.raises(ValueError):
        chunked_logprobs(hidden.float(), weight.float(), targets, backend="cuda")


@pytest.mark.parametrize("chunk", [1, 7, 64])
def test_fused_loss_matches_autograd_of_logprobs(chunk):
    from kernels.logprob_loss import chunked_logprob_loss

    hidden, weight, targets, g_lp, _ = _inputs(29, 83, 24, seed=4)
    coef = g_lp.float()

    def token_loss(lp, sl):  # a non-linear per-token loss, like the clipped policy loss
        return (coef[sl] * torch.exp(lp) + 0.3 * lp.clamp(min=-3.0)).sum() / 7.0

    h1, w1 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    lp, ent = naive_logprobs(h1, w1, targets)
    ref = token_loss(lp, slice(None))
    (2.5 * ref).backward()
    h2, w2 = hidden.float().requires_grad_(), weight.float().requires_grad_()
    loss, lp2, ent2 = chunked_logprob_loss(h2, w2, targets, token_loss, chunk_size=chunk, backend="torch")
    (2.5 * loss).backward()
    torch.testing.assert_close(loss, ref.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lp2, lp.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ent2, ent.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-5, rtol=1e-4)
    assert not lp2.requires_grad and not ent2.requires_grad

"""Device placement and dtype policy (trainer/device.py): the CPU path is fp32 without autocast,
CUDA without a GPU is a clear error, and the CUDA policy (bf16 autocast over fp32 master weights,
pinned non-blocking batches) runs where a GPU exists."""

from __future__ import annotations

import pytest
import torch

from app.core.errors import ConfigurationError
from app.inference.device import resolve_device
from trainer.batching import MicroBatch
from trainer.config import load_config
from trainer.device import Placement, setup_placement

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _batch() -> MicroBatch:
    return MicroBatch(
        input_ids=torch.arange(8).view(2, 4),
        attention_mask=torch.ones(2, 4, dtype=torch.int64),
        hidden_index=torch.tensor([0, 5]),
        targets=torch.tensor([1, 6]),
        behaviour_logprobs=torch.tensor([-1.0, -2.0]),
        advantages=torch.tensor([0.5, 0.5]),
        trajectory_index=torch.tensor([0, 1]),
    )


def test_config_device_defaults_to_auto_and_refuses_unknown_values():
    assert load_config().device == "auto"
    assert load_config(overrides={"device": "cpu"}).device == "cpu"
    with pytest.raises(ConfigurationError):
        load_config(overrides={"device": "tpu"})


def test_cpu_placement_is_fp32_without_autocast():
    placement = setup_placement("cpu")
    assert placement.device == torch.device("cpu") and not placement.is_cuda
    assert placement.param_dtype == placement.compute_dtype == torch.float32
    model = placement.place_model(torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert model.weight.dtype == torch.float32
    with placement.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert model(torch.ones(1, 4)).dtype == torch.float32
    mb = _batch()
    assert placement.move_batch(mb) is mb  # nothing copied on the CPU
    assert placement.describe() == {"device": "cpu", "param_dtype": "float32", "compute_dtype": "float32"}


def test_auto_follows_the_machine():
    expected = "cuda" if torch.cuda.is_available() else "cpu"
    assert resolve_device("auto").type == expected


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_cuda_without_a_gpu_is_a_clear_error():
    with pytest.raises(ConfigurationError, match="no CUDA GPU"):
        resolve_device("cuda")
    with pytest.raises(ConfigurationError, match="no CUDA GPU"):
        setup_placement("cuda")


def test_unknown_device_is_refused():
    with pytest.raises(ConfigurationError, match="unknown device"):
        resolve_device("gpu")


def test_bf16_placement_autocasts_matmuls_and_keeps_fp32_master_weights():
    """The CUDA policy's arithmetic, on the CPU's autocast: bf16 compute, fp32 weights and grads."""
    placement = Placement(device=torch.device("cpu"), compute_dtype=torch.bfloat16)
    model = placement.place_model(torch.nn.Linear(4, 4))
    with placement.autocast():
        out = model(torch.ones(2, 4))
    assert out.dtype == torch.bfloat16
    out.float().sum().backward()
    assert model.weight.dtype == model.weight.grad.dtype == torch.float32


@needs_cuda
def test_cuda_placement_moves_pinned_batches_and_uses_the_triton_kernel():
    from kernels import chunked_logprobs

    placement = setup_placement("cuda")
    assert placement.compute_dtype == torch.bfloat16 and placement.param_dtype == torch.float32
    assert torch.backends.cuda.matmul.allow_tf32
    mb = placement.move_batch(_batch())
    assert mb.input_ids.is_cuda and mb.targets.is_cuda
    weight = torch.randn(64, 32, device=placement.device, requires_grad=True)
    hidden = torch.randn(5, 32, device=placement.device, requires_grad=True)
    targets = torch.randint(0, 64, (5,), device=placement.device)
    with placement.autocast():
        lp, _ = chunked_logprobs(hidden, weight, targets, None, "auto")
    ref = torch.log_softmax(hidden.float() @ weight.float().T, -1).gather(1, targets[:, None]).squeeze(1)
    torch.testing.assert_close(lp, ref, atol=5e-2, rtol=0)
    lp.sum().backward()
    assert weight.grad.dtype == torch.float32


@needs_cuda
def test_cuda_cycle_trains_in_fp32_master_weights(tmp_path):
    from tests.unit.test_trainer_distributed import _config, _trajectories
    from trainer.testing import tiny_policy
    from trainer.training import train_policy

    tiny_policy(seed=3).save_pretrained(tmp_path, safe_serialization=True)
    trained = train_policy(_config(device="cuda"), tmp_path, _trajectories())
    assert all(p.is_cuda and p.dtype == torch.float32 for p in trained.model.parameters())
    assert all(torch.isfinite(torch.tensor(m.loss)) for m in trained.history)

"""Device placement and dtype policy (trainer/device.py): fp32 compute runs without autocast; ``auto``
precision is bf16 on CPUs whose flags say they compute it natively and fp32 elsewhere; a CPU cycle in
bf16 runs its forward passes under autocast, the LM head included, over fp32 master weights and AdamW
state; CUDA without a GPU is a clear error, and the CUDA policy (bf16 autocast over fp32 master
weights, pinned non-blocking batches) runs where a GPU exists."""

from __future__ import annotations

import math

import pytest
import torch

import app.core.cpu
import app.inference.precision
import kernels.logprob_loss
import kernels.reference
import trainer.training
from app.core.errors import ConfigurationError
from app.inference.device import resolve_device
from tests.unit.test_precision import decide_afresh, fake_probe  # noqa: F401 (fixture)
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
    placement = setup_placement("cpu", precision="fp32")
    assert placement.device == torch.device("cpu") and not placement.is_cuda
    assert placement.param_dtype == placement.compute_dtype == torch.float32
    model = placement.place_model(torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert model.weight.dtype == torch.float32
    with placement.autocast():
        assert not torch.is_autocast_enabled("cpu")
        assert model(torch.ones(1, 4)).dtype == torch.float32
    mb = _batch()
    assert placement.move_batch(mb) is mb  # nothing copied on the CPU
    assert placement.describe() == {
        "device": "cpu",
        "param_dtype": "float32",
        "compute_dtype": "float32",
        "precision": "fp32",
    }


def test_cpu_flags_are_read_from_cpuinfo(tmp_path, monkeypatch):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx512f avx512_bf16\nbugs\t\t: spectre_v1\n")
    monkeypatch.setattr(app.core.cpu, "CPUINFO", cpuinfo)
    assert app.core.cpu.cpu_flags() == {"fpu", "sse2", "avx512f", "avx512_bf16"} and app.core.cpu.cpu_has_bf16()
    cpuinfo.write_text("flags\t\t: fpu sse2 avx2 avx512f\n")
    assert not app.core.cpu.cpu_has_bf16()
    monkeypatch.setattr(app.core.cpu, "CPUINFO", tmp_path / "absent")
    assert app.core.cpu.cpu_flags() == set() and not app.core.cpu.cpu_has_bf16()


@pytest.mark.parametrize(
    ("flags", "precision", "speedup", "expected"),
    [
        ({"avx2", "amx_bf16"}, "auto", 2.5, torch.bfloat16),
        ({"avx512f", "avx512_bf16"}, "auto", 1.6, torch.bfloat16),
        ({"avx512f", "avx512_bf16"}, "auto", 0.7, torch.float32),  # measured slower: fp32
        ({"avx2", "avx512f"}, "auto", 3.0, torch.float32),  # bf16 would be emulated: fp32
        (set(), "auto", 3.0, torch.float32),  # no /proc/cpuinfo
        ({"amx_bf16"}, "fp32", 2.5, torch.float32),
        (set(), "bf16", 0.5, torch.bfloat16),  # asked for: emulated, with a warning
    ],
)
def test_cpu_precision_follows_the_flags_and_the_probe(monkeypatch, decide_afresh, flags, precision, speedup, expected):
    monkeypatch.setattr(app.core.cpu, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(app.inference.precision, "cached_probe", lambda: fake_probe(speedup))
    placement = setup_placement("cpu", precision=precision)
    assert placement.compute_dtype == expected and placement.param_dtype == torch.float32
    assert placement.describe()["precision"] == {torch.bfloat16: "bf16", torch.float32: "fp32"}[expected]
    with placement.autocast():
        assert torch.is_autocast_enabled("cpu") == (expected == torch.bfloat16)


def test_config_precision_and_unknown_values():
    assert load_config().precision == "auto"
    assert load_config(overrides={"precision": "bf16"}).precision == "bf16"
    with pytest.raises(ConfigurationError):
        load_config(overrides={"precision": "fp16"})
    with pytest.raises(ConfigurationError, match="unknown precision"):
        setup_placement("cpu", precision="fp16")


@pytest.mark.parametrize(
    ("flags", "speedup", "expected"),
    [({"amx_bf16"}, 2.5, torch.bfloat16), ({"avx512_bf16"}, 0.7, torch.float32), ({"avx2"}, 3.0, torch.float32)],
)
def test_cpu_cycle_computes_in_the_resolved_precision_over_fp32_master_state(
    tmp_path, monkeypatch, decide_afresh, flags, speedup, expected
):
    """A whole cycle (pi_old pass and steps) on the CPU with ``precision = "auto"``: the decoder's
    matmuls and the LM head run in the resolved dtype; weights, their gradients and AdamW state stay fp32."""
    from tests.unit.test_trainer_distributed import _config, _trajectories
    from trainer.testing import tiny_policy
    from trainer.training import train_policy

    monkeypatch.setattr(app.core.cpu, "cpu_flags", lambda: set(flags))
    monkeypatch.setattr(app.inference.precision, "cached_probe", lambda: fake_probe(speedup))
    seen: dict[str, set] = {"decoder": set(), "autocast": set(), "head": set(), "grad": set()}
    forward = kernels.reference.chunk_forward

    def recording_chunk_forward(h, weight, *args):  # the LM head of both log-prob paths
        seen["head"].add((h.dtype, weight.dtype))
        return forward(h, weight, *args)

    monkeypatch.setattr(kernels.reference, "chunk_forward", recording_chunk_forward)
    monkeypatch.setattr(kernels.logprob_loss, "chunk_forward", recording_chunk_forward)
    load_policy = trainer.training.load_policy

    def hooked_policy(path):
        model = load_policy(path)

        def record(module, inputs, output):
            seen["decoder"].add(output.dtype)
            seen["autocast"].add(torch.is_autocast_enabled("cpu"))

        model.model.layers[0].mlp.down_proj.register_forward_hook(record)
        for param in (model.model.layers[0].mlp.down_proj.weight, model.lm_head.weight):
            param.register_hook(lambda grad: seen["grad"].add(grad.dtype))
        return model

    monkeypatch.setattr(trainer.training, "load_policy", hooked_policy)
    tiny_policy(seed=3).save_pretrained(tmp_path, safe_serialization=True)
    trained = train_policy(_config(precision="auto"), tmp_path, _trajectories())

    assert trained.placement.compute_dtype == expected
    assert seen["decoder"] == {expected} and seen["autocast"] == {expected == torch.bfloat16}
    assert seen["head"] == {(expected, expected)} and seen["grad"] == {torch.float32}
    assert all(p.dtype == torch.float32 for p in trained.model.parameters())
    state = [t for s in trained.optimizer.state.values() for t in s.values() if t.dim() > 0]
    assert state and all(t.dtype == torch.float32 for t in state)  # exp_avg, exp_avg_sq
    assert all(math.isfinite(m.loss) and not m.skipped_step for m in trained.history)
    initial = tiny_policy(seed=3).state_dict()
    assert any(not torch.equal(initial[k], v) for k, v in trained.model.state_dict().items())


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

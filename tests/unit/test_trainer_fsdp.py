"""FSDP2 (``parallel.mode = "fsdp"``) on 2 gloo ranks trains what one process trains: the same
pi_old statistics, per-step losses and gradient norms, the same published weights, with a rank
left without a micro-batch (filler passes) and a micro-batch whose loss is not finite (skipped by
both); the gathered model keeps its embeddings tied to the LM head."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.fsdp import FSDPModule

from app.checkpoints.testing import build_tiny_model
from app.core.errors import ConfigurationError
from tests.unit.test_trainer_distributed import LR, _assert_same_training, _config, _trajectories
from trainer.checkpointing import load_policy
from trainer.config import TrainerConfig
from trainer.testing import train_on_ranks, train_sharded_in_process


def test_fsdp_config_refuses_what_it_cannot_shard():
    with pytest.raises(ValueError, match="save_optimizer"):
        TrainerConfig.model_validate({"parallel": {"mode": "fsdp"}, "save_optimizer": True})
    with pytest.raises(ValueError, match="cpu_offload with device cpu"):
        TrainerConfig.model_validate({"device": "cpu", "parallel": {"mode": "fsdp", "cpu_offload": True}})
    assert TrainerConfig.model_validate({"parallel": {"mode": "fsdp"}}).parallel.reshard_after_forward


def test_two_fsdp_ranks_train_and_publish_what_one_process_does(tmp_path):
    model_dir = build_tiny_model(tmp_path / "policy", seed=3, num_layers=2, hidden_size=64)
    initial = load_policy(model_dir).state_dict()
    trajectories = _trajectories(poisoned=5)
    torch.set_num_threads(1)
    one = train_on_ranks(model_dir, trajectories, _config(), 1, tmp_path / "one")
    two = train_on_ranks(model_dir, trajectories, _config(parallel={"mode": "fsdp"}), 2, tmp_path / "two")

    assert len(one["history"]) == len(two["history"]) == 4  # 2 epochs x ceil(4 micro-batches / 3)
    skipped = [h["skipped_micro_batches"] for h in one["history"]]
    assert sum(skipped) == 2 and [h["skipped_micro_batches"] for h in two["history"]] == skipped
    # step 1 skipped a micro-batch and still stepped (its zero backward kept the ranks in step);
    # step 4's only micro-batch was the skipped one, in one process as on the ranks
    assert [h["skipped_step"] for h in two["history"]] == [h["skipped_step"] for h in one["history"]]
    assert skipped[0] == 1 and not two["history"][0]["skipped_step"]
    for key in ("mismatch_kl", "old_entropy"):
        assert two["mismatch"][key] == pytest.approx(one["mismatch"][key], rel=1e-5, nan_ok=True)  # NaN: poisoned
    _assert_same_training(one, two)
    moved = max(float((one["state"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 0.5 * LR  # training changed the weights, so equal weights mean something

    # what rank 0 publishes: the full fp32 safetensors, one shared tensor for the tied embeddings
    published = load_file(two["published"] / "model.safetensors")
    assert set(published) <= set(one["state"]) and "model.embed_tokens.weight" in published
    for name, tensor in published.items():
        assert tensor.dtype == torch.float32
        torch.testing.assert_close(tensor, one["state"][name], rtol=0, atol=1e-2 * LR, msg=name)
    reloaded = load_policy(two["published"])
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert two["tied"]


_GPU = pytest.mark.skipif(not torch.cuda.is_available(), reason="no GPU")


@pytest.mark.parametrize(
    ("device", "precision", "cpu_offload"),
    [
        ("cpu", "fp32", False),  # gloo: the path CI runs
        pytest.param("cuda", "fp32", False, marks=_GPU),
        pytest.param("cuda", "fp32", True, marks=_GPU),
        pytest.param("cuda", "bf16", False, marks=_GPU),
    ],
)
def test_one_sharded_rank_trains_what_one_process_does(tmp_path, device, precision, cpu_offload):
    """FSDP2 on one rank in this process (NCCL on a GPU, gloo on the CPU) against the unsharded model:
    the mesh, ``fully_shard``, ``CPUOffloadPolicy`` (AdamW on host shards) and the gathered full state
    dict train what one process trains, in fp32 up to summation order. In bf16 FSDP2's
    ``MixedPrecisionPolicy`` casts the weights once per gather where autocast casts per op, so only the
    losses and the first step's gradient norm are compared: with the test's near-zero advantages Adam
    turns bf16 rounding into update directions (measured on an H200: weights 4.2e-3 apart after moving
    2.7e-3)."""
    model_dir = build_tiny_model(tmp_path / "policy", seed=3, num_layers=2, hidden_size=64)
    trajectories = _trajectories()
    settings = {"device": device, "precision": precision}
    torch.set_num_threads(1)
    one = train_on_ranks(model_dir, trajectories, _config(**settings), 1, tmp_path / "one")
    fsdp = {"mode": "fsdp", "cpu_offload": cpu_offload}
    sharded = train_sharded_in_process(
        model_dir, trajectories, _config(**settings, parallel=fsdp), tmp_path / "sharded"
    )

    assert len(sharded["history"]) == len(one["history"]) == 4
    assert sharded["tied"]
    assert all(t.dtype == torch.float32 for t in sharded["state"].values())
    assert (sharded["peak_cuda_bytes"] > 0) == (device == "cuda")
    if precision == "fp32":
        _assert_same_training(one, sharded)
        return
    for a, b in zip(one["history"], sharded["history"], strict=True):
        assert b["loss"] == pytest.approx(a["loss"], rel=2e-2, abs=1e-3), a["step"]
    assert sharded["history"][0]["grad_norm"] == pytest.approx(one["history"][0]["grad_norm"], rel=5e-2)


def test_an_moe_model_is_refused_where_torch_cannot_reduce_its_unused_experts(tmp_path, monkeypatch):
    """torch before 2.13 (2.11 on GPU images) has no ``set_reduce_scatter_unused_params``: an expert
    no token routed to would leave the ranks' collectives out of step, so the MoE model is refused."""
    monkeypatch.delattr(FSDPModule, "set_reduce_scatter_unused_params")
    model_dir = build_tiny_model(tmp_path / "policy", seed=3, moe=True)
    config = _config(parallel={"mode": "fsdp"})
    with pytest.raises(ConfigurationError, match="MoE model needs torch >= 2.13"):
        train_sharded_in_process(model_dir, _trajectories(), config, tmp_path / "sharded")

"""Weight deltas: bit-exact round trip, refusal of the wrong parent, corruption detection."""

from __future__ import annotations

import copy

import pytest
import torch

from app.checkpoints.delta import apply_delta, read_delta_header, serving_state_dict, write_delta
from app.core.errors import CheckpointError


def _tiny_llama(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(
        vocab_size=300,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
    )
    return LlamaForCausalLM(cfg)


def _rl_like_step(model, lr=1e-6, dense_name=None):
    """A small update to every weight (most bf16 values unchanged) and optionally a large one;
    returns the child's state dict (tied weights stay tied, as after a real optimizer step)."""
    child = copy.deepcopy(model)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, t in child.named_parameters():
            t.add_(torch.randn(t.shape, generator=g) * lr)
            if name == dense_name:
                t.add_(torch.randn(t.shape, generator=g))
    return child.state_dict()


@pytest.mark.parametrize("checksum", ["xxh3_128", "sha256"])
def test_round_trip_is_bit_exact(tmp_path, monkeypatch, checksum):
    if checksum == "xxh3_128":
        pytest.importorskip("xxhash")
    monkeypatch.setattr("app.checkpoints.delta._default_checksum", lambda: checksum)
    model = _tiny_llama(0)
    parent = model.state_dict()
    child = _rl_like_step(model, dense_name="model.layers.0.mlp.up_proj.weight")
    stats = write_delta(parent, child, tmp_path / "delta.zst", parent_id="p", checkpoint_id="c")
    assert 0 < stats.changed_elements < stats.total_elements
    header = read_delta_header(tmp_path / "delta.zst")
    encodings = {e["name"]: e["encoding"] for e in header["tensors"]}
    assert encodings["model.layers.0.mlp.up_proj.weight"] == "xor"
    assert "sparse" in encodings.values()
    assert "lm_head.weight" not in encodings  # tied to the embeddings: stored once
    assert header["parent_id"] == "p" and header["checkpoint_id"] == "c" and header["checksum"] == checksum

    rebuilt = apply_delta(serving_state_dict(parent), tmp_path / "delta.zst")
    expected = serving_state_dict(child)
    assert set(rebuilt) == set(expected)
    for name, t in expected.items():
        assert rebuilt[name].dtype == torch.bfloat16
        assert torch.equal(rebuilt[name].view(torch.int16), t.view(torch.int16)), name
    # the engine passes its fp32 state dict, tied alias included: same result, alias kept
    from_fp32 = apply_delta(parent, tmp_path / "delta.zst")
    assert torch.equal(
        from_fp32["lm_head.weight"].view(torch.int16), expected["model.embed_tokens.weight"].view(torch.int16)
    )
    assert torch.equal(
        from_fp32["model.norm.weight"].view(torch.int16), expected["model.norm.weight"].view(torch.int16)
    )


def test_small_step_gives_small_delta(tmp_path):
    model = _tiny_llama(0)
    stats = write_delta(model.state_dict(), _rl_like_step(model), tmp_path / "d.zst")
    assert stats.changed_elements / stats.total_elements < 0.2
    assert stats.ratio < 0.25


def test_identical_weights_give_empty_delta(tmp_path):
    model = _tiny_llama(0)
    stats = write_delta(model.state_dict(), model.state_dict(), tmp_path / "d.zst")
    assert stats.changed_elements == 0 and stats.delta_bytes < 4096
    rebuilt = apply_delta(model.state_dict(), tmp_path / "d.zst")
    assert torch.equal(rebuilt["model.norm.weight"].float(), model.state_dict()["model.norm.weight"].bfloat16().float())


def test_refuses_wrong_parent(tmp_path):
    model = _tiny_llama(0)
    write_delta(model.state_dict(), _rl_like_step(model), tmp_path / "d.zst", parent_id="p")
    with pytest.raises(CheckpointError, match="another parent"):
        apply_delta(_tiny_llama(1).state_dict(), tmp_path / "d.zst")
    # one flipped bit in one tensor is another parent too
    off_by_one = serving_state_dict(model)
    off_by_one["model.norm.weight"] = off_by_one["model.norm.weight"].clone()
    off_by_one["model.norm.weight"].view(torch.int16)[0] ^= 1
    with pytest.raises(CheckpointError, match="another parent"):
        apply_delta(off_by_one, tmp_path / "d.zst")
    missing = dict(serving_state_dict(model))
    missing.pop("model.norm.weight")
    with pytest.raises(CheckpointError, match="tensors"):
        apply_delta(missing, tmp_path / "d.zst")


def test_detects_corruption_and_garbage(tmp_path):
    model = _tiny_llama(0)
    path = tmp_path / "d.zst"
    write_delta(model.state_dict(), _rl_like_step(model, dense_name="model.norm.weight"), path)
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    bad = tmp_path / "bad.zst"
    bad.write_bytes(bytes(raw))
    with pytest.raises(CheckpointError):
        apply_delta(model.state_dict(), bad)
    (tmp_path / "junk.zst").write_bytes(b"not a delta at all")
    with pytest.raises(CheckpointError):
        apply_delta(model.state_dict(), tmp_path / "junk.zst")


def test_write_refuses_mismatched_models(tmp_path):
    model = _tiny_llama(0)
    child = dict(_rl_like_step(model))
    child["extra.weight"] = torch.zeros(3)
    with pytest.raises(CheckpointError):
        write_delta(model.state_dict(), child, tmp_path / "d.zst")

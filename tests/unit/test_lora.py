"""LoRA cycles (``trainer/lora.py``): the first step's forward is the parent's, the update moves
log-probs the way the advantages say (and the other way with ``invert_reward``), and the merged
checkpoint is a plain model whose change is low-rank on the adapted layers and nil elsewhere."""

from __future__ import annotations

import math

import pytest
import torch

from app.core.errors import ConfigurationError
from trainer.checkpointing import load_policy
from trainer.config import TrainerConfig, load_config
from trainer.lora import attach_adapters, merge_adapters, trainable_parameters
from trainer.testing import BAD, GOOD, PROMPT, good_bad_trajectories, sequence_logprobs, tiny_policy
from trainer.training import train_policy

RANK = 4


def _config(rank: int = RANK, **kw) -> TrainerConfig:
    return TrainerConfig.model_validate(
        {
            "epochs": 1,
            "grad_accum": 1,
            "precision": "fp32",
            "pi_old": "behaviour",
            "logprob_chunk_size": 16,
            "data": {"micro_batch_tokens": 20},  # 2 rows per micro-batch: 2 steps
            "loss": {"temperature": 1.0},
            "optim": {"lr": 1e-2},
            "lora": {"rank": rank, "alpha": 2.0 * rank if rank else 32.0},
            **kw,
        }
    )


@pytest.fixture()
def parent(tmp_path):
    model = tiny_policy(seed=3)
    model.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path


def _completion_logprob(model, completion) -> float:
    return float(sequence_logprobs(model, PROMPT + completion)[-len(completion) :].sum())


def test_merged_checkpoint_is_the_parent_plus_a_low_rank_change(parent):
    before = load_policy(parent)
    trained = train_policy(_config(), parent, good_bad_trajectories(before))

    state, initial = trained.model.state_dict(), before.state_dict()
    assert state.keys() == initial.keys()  # no adapter or base_layer names reach the checkpoint
    assert all(p.requires_grad for p in trained.model.parameters())
    changed = {k for k in state if not torch.equal(state[k], initial[k])}
    adapted = {k for k in changed if k.endswith("proj.weight")}
    assert changed == adapted and len(adapted) == 7 * before.config.num_hidden_layers  # q k v o gate up down
    for key in adapted:
        assert torch.linalg.matrix_rank(state[key] - initial[key]).item() <= RANK
    assert torch.equal(state["model.embed_tokens.weight"], initial["model.embed_tokens.weight"])
    assert len(trained.history) == 2 and all(math.isfinite(m.loss) for m in trained.history)
    assert not trained.optimizer.state or all(
        t.numel() < before.model.layers[0].mlp.down_proj.weight.numel()
        for s in trained.optimizer.state.values()
        for t in s.values()
        if t.dim() > 0
    )  # adapter-sized AdamW state


def test_first_step_sees_the_parent_as_full_fine_tuning_does(parent):
    model = load_policy(parent)
    trajectories = good_bad_trajectories(model)
    lora = train_policy(_config(), parent, trajectories).history[0]
    full = train_policy(_config(rank=0), parent, trajectories).history[0]
    assert lora.loss == pytest.approx(full.loss, abs=1e-6)
    assert lora.kl == pytest.approx(full.kl, abs=1e-7) and lora.entropy == pytest.approx(full.entropy, abs=1e-6)


@pytest.mark.parametrize("invert", [False, True])
def test_update_follows_the_advantages(parent, invert):
    before = load_policy(parent)
    trajectories = good_bad_trajectories(before)
    trained = train_policy(_config(invert_reward=invert), parent, trajectories).model
    trained.eval()
    good = _completion_logprob(trained, GOOD) - _completion_logprob(before, GOOD)
    bad = _completion_logprob(trained, BAD) - _completion_logprob(before, BAD)
    assert abs(good - bad) > 1e-3  # not a no-op
    assert (good > bad) != invert


def test_adapters_train_a_small_share_and_merge_in_place():
    model = tiny_policy(seed=1)
    total = trainable_parameters(model)
    wrapped = attach_adapters(model, _config().lora)
    assert 0 < trainable_parameters(model) < total / 4  # the parent's weights are frozen
    merged = merge_adapters(wrapped)
    assert (
        trainable_parameters(merged) == total and merged.state_dict().keys() == tiny_policy(seed=1).state_dict().keys()
    )


def test_config_refuses_saving_adapter_optimizer_state():
    with pytest.raises(ConfigurationError) as refused:
        load_config(overrides={"lora.rank": 16, "save_optimizer": True})
    assert "save_optimizer with lora.rank > 0" in " ".join(refused.value.reasons)
    with pytest.raises(ConfigurationError) as refused:
        load_config(overrides={"lora.rank": -1})
    assert any(r.startswith("lora.rank:") for r in refused.value.reasons)
    assert load_config().lora.rank == 0  # full fine-tuning by default


def test_the_seed_fixes_the_adapters_and_so_the_update(parent):
    """``seed`` seeds LoRA's random adapter initialisation: the same seed trains the same weights
    (whatever the global RNG did in between), another seed other ones."""
    trajectories = good_bad_trajectories(load_policy(parent))

    def weights(seed: int, disturb: int) -> dict[str, torch.Tensor]:
        torch.manual_seed(disturb)  # another global RNG state each time: only the config's seed may matter
        return train_policy(_config(seed=seed), parent, trajectories).model.state_dict()

    a, b, c = weights(5, 1), weights(5, 2), weights(6, 1)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], c[k]) for k in a if k.endswith("proj.weight"))

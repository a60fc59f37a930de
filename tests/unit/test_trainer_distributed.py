"""Data parallel on 2 gloo ranks (spawned processes, file:// rendezvous) trains exactly what one
process trains: same pi_old statistics, per-step losses and gradient norms, same final weights; the
gradients are all-reduced by DDP inside the backward pass, once per step, also on a rank left
without a micro-batch or whose last micro-batch's loss is not finite."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from trainer.config import TrainerConfig
from trainer.distributed import DataParallel
from trainer.testing import make_segment, make_trajectory, tiny_policy, train_on_ranks

LR = 1e-3


def _trajectories(n: int = 6, poisoned: int | None = None):
    """``n`` trajectories; ``poisoned``: that one's behaviour log-probs hold a NaN (its loss is not finite)."""
    rng = np.random.default_rng(1)
    out = []
    for i in range(n):
        prompt = rng.integers(3, 500, size=12 + 4 * i).tolist()
        completion = rng.integers(3, 500, size=10 + 3 * i).tolist()
        behaviour = rng.normal(-6.0, 0.3, size=len(prompt) + len(completion))
        if i == poisoned:
            behaviour[len(prompt) + 1] = float("nan")
        out.append(make_trajectory([make_segment(prompt, completion, behaviour)], float(i % 3 == 0), f"t{i // 2}"))
    return out


def _config(**kw) -> TrainerConfig:
    # grad_accum=3 over 4 micro-batches: the last step of each epoch is short, so a rank
    # is left without a micro-batch in some step. Adam eps 1e-6 bounds how far it scales the
    # rounding of near-zero gradients (lr / eps), which differs between one sum and an all-reduce.
    return TrainerConfig.model_validate(
        {
            "grad_accum": 3,
            "epochs": 2,
            "device": "cpu",
            "precision": "fp32",  # the same arithmetic on every host, whatever its bf16 flags
            "data": {"micro_batch_tokens": 96},
            "optim": {"lr": LR, "eps": 1e-6},
            **kw,
        }
    )


def test_local_share_and_ownership_cover_every_item_once():
    items = list(range(7))
    ranks = [DataParallel(r, 3) for r in range(3)]
    assert sorted(x for dp in ranks for x in dp.local(items)) == items
    assert [sum(dp.owns(i) for dp in ranks) for i in items] == [1] * 7
    assert DataParallel(0, 3).is_main and not DataParallel(2, 3).is_main


def test_two_gloo_ranks_train_what_one_process_trains(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_policy(seed=3).save_pretrained(model_dir, safe_serialization=True)
    trajectories, config = _trajectories(), _config()
    torch.set_num_threads(1)
    one = train_on_ranks(model_dir, trajectories, config, 1, tmp_path / "one")
    two = train_on_ranks(model_dir, trajectories, config, 2, tmp_path / "two")

    assert len(one["history"]) == len(two["history"]) == 4  # 2 epochs x ceil(4 micro-batches / 3)
    for key in ("mismatch_kl", "old_entropy"):
        assert two["mismatch"][key] == pytest.approx(one["mismatch"][key], rel=1e-5)
    _assert_same_training(one, two)
    initial = tiny_policy(seed=3).state_dict()
    moved = max(float((one["state"][k] - initial[k]).abs().max()) for k in initial)
    assert moved > 0.5 * LR  # training changed the weights, so equal weights mean something
    _assert_ddp_reduced_once_per_step(two, tiny_policy(seed=3), steps=4)
    # the second step of each epoch holds one micro-batch: rank 1 has none and still joins the all-reduce
    assert two["ranks"][1]["flushes"] == [False, True, False, True]


@pytest.mark.parametrize(
    ("overrides", "steps"),
    [
        ({"max_kl_per_token": 0.01}, 3),  # step 3's forward measures KL 0.07 to pi_old: stopped there
        ({"pi_old": "behaviour", "epochs": 1}, 2),
    ],
    ids=["update-watch", "behaviour-pi-old"],
)
def test_two_gloo_ranks_in_bf16_train_and_stop_as_one_process(tmp_path, overrides, steps):
    """bf16 autocast under DDP, with the update watch (every rank reads the all-reduced KL, so all
    stop at the same step) or with the behaviour log-probs as pi_old (no pi_old broadcast)."""
    model_dir = tmp_path / "policy"
    tiny_policy(seed=3).save_pretrained(model_dir, safe_serialization=True)
    trajectories, config = _trajectories(), _config(precision="bf16", **overrides)
    torch.set_num_threads(1)
    one = train_on_ranks(model_dir, trajectories, config, 1, tmp_path / "one")
    two = train_on_ranks(model_dir, trajectories, config, 2, tmp_path / "two")

    assert len(one["history"]) == len(two["history"]) == steps
    stopped = [h["stopped_early"] for h in two["history"]]
    assert stopped == [h["stopped_early"] for h in one["history"]]
    assert (stopped[-1] is not None) == ("max_kl_per_token" in overrides) and not any(stopped[:-1])
    _assert_same_training(one, two)
    _assert_ddp_reduced_once_per_step(two, tiny_policy(seed=3), steps=steps)


def test_a_rank_whose_last_loss_is_not_finite_still_reduces(tmp_path):
    model_dir = tmp_path / "policy"
    tiny_policy(seed=3).save_pretrained(model_dir, safe_serialization=True)
    trajectories, config = _trajectories(poisoned=5), _config()
    torch.set_num_threads(1)
    one = train_on_ranks(model_dir, trajectories, config, 1, tmp_path / "one")
    two = train_on_ranks(model_dir, trajectories, config, 2, tmp_path / "two")

    skipped = [h["skipped_micro_batches"] for h in one["history"]]
    assert sum(skipped) == 2 and [h["skipped_micro_batches"] for h in two["history"]] == skipped  # once per epoch
    _assert_same_training(one, two)
    _assert_ddp_reduced_once_per_step(two, tiny_policy(seed=3), steps=4)
    # finish_step reduced where a rank's last micro-batch was the skipped one (rank 1 in step 1,
    # rank 0 in step 4) and where a rank had none (rank 1 in steps 2 and 4)
    assert [r["flushes"] for r in two["ranks"]] == [[False, False, False, True], [True, True, False, True]]


def _assert_same_training(one: dict, two: dict) -> None:
    for a, b in zip(one["history"], two["history"], strict=True):
        assert (b["tokens"], b["trainable_tokens"]) == (a["tokens"], a["trainable_tokens"])
        # the gradient norm catches a mean over ranks (half of it) or a missing all-reduce
        for key in ("loss", "grad_norm", "kl", "entropy", "ratio"):
            assert b[key] == pytest.approx(a[key], rel=1e-4, abs=1e-7), (a["step"], key)
    for name, p in one["state"].items():
        torch.testing.assert_close(two["state"][name], p, rtol=0, atol=1e-2 * LR, msg=name)


def _assert_ddp_reduced_once_per_step(two: dict, model: torch.nn.Module, steps: int) -> None:
    """Every fp32 all_reduce ran inside a backward pass (DDP's bucket hook, overlapped with the
    backward) and each rank reduced every parameter once per step (``no_sync`` on the others)."""
    numel = sum(p.numel() for p in model.parameters())  # the tied embedding once
    for rank in two["ranks"]:
        assert rank["reductions"] and all(inside for _, inside in rank["reductions"])
        assert sum(n for n, _ in rank["reductions"]) == steps * numel

"""The RL step end to end on a tiny random policy (no database): a reward that favours one token
sequence raises that sequence's log-prob within a few steps, and lowers the disfavoured one."""

from __future__ import annotations

import pytest
import torch

from trainer.batching import group_ids, pack_micro_batches
from trainer.config import TrainerConfig
from trainer.loss import compute_advantages
from trainer.step import compute_old_logprobs, make_optimizer, micro_batch_schedule, train_steps
from trainer.testing import make_segment, make_trajectory, sequence_logprobs, tiny_policy

PROMPT = [1, 40, 41, 42, 43]
GOOD = [100, 101, 102, 103, 104, 2]
BAD = [200, 201, 202, 203, 204, 2]


def _completion_logprob(model, completion, temperature=1.0) -> float:
    return float(sequence_logprobs(model, PROMPT + completion, temperature)[len(PROMPT) :].sum())


@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_fixed_reward_raises_favoured_sequence(temperature):
    torch.manual_seed(0)
    model = tiny_policy(seed=0)
    trajectories = []
    for _k in range(3):
        for completion, reward in ((GOOD, 1.0), (BAD, 0.0)):
            behaviour = sequence_logprobs(model, PROMPT + completion, temperature)
            trajectories.append(make_trajectory([make_segment(PROMPT, completion, behaviour)], reward, task_id="t"))
    config = TrainerConfig.model_validate(
        {
            "epochs": 2,
            "grad_accum": 2,
            "logprob_chunk_size": 5,
            "data": {"micro_batch_tokens": 22},
            "loss": {"temperature": temperature},
            "optim": {"lr": 3e-3},
        }
    )
    adv = compute_advantages(torch.tensor([t.reward for t in trajectories]), group_ids(trajectories))
    assert adv.tolist() == pytest.approx([0.5, -0.5] * 3)
    batches = pack_micro_batches(trajectories, adv, micro_batch_tokens=22, pad_id=2)
    assert len(batches) == 3 and all(b.input_ids.shape[0] == 2 for b in batches)
    good0, bad0 = _completion_logprob(model, GOOD, temperature), _completion_logprob(model, BAD, temperature)

    mismatch = compute_old_logprobs(model, batches, config)
    assert mismatch["mismatch_kl"] == pytest.approx(0.0, abs=1e-5)  # behaviour = parent: on-policy
    history = train_steps(model, batches, config, make_optimizer(model, config))

    assert len(history) == 4
    assert history[0].ratio == pytest.approx(1.0, abs=1e-5) and history[0].is_clip_frac == 0.0
    assert history[-1].kl > 0 and history[0].grad_norm > 0
    good1, bad1 = _completion_logprob(model, GOOD, temperature), _completion_logprob(model, BAD, temperature)
    assert good1 > good0 + 0.5, (good0, good1)
    assert bad1 < bad0 - 0.5, (bad0, bad1)


def test_schedule_trains_every_micro_batch_each_epoch():
    from trainer.step import planned_steps

    batches = list(range(3))
    cfg = TrainerConfig.model_validate({"grad_accum": 2, "epochs": 2})
    groups = list(micro_batch_schedule(batches, cfg))
    assert [len(g) for g in groups] == [2, 1, 2, 1] and planned_steps(3, cfg) == 4
    assert sorted(groups[0] + groups[1]) == [0, 1, 2] and sorted(groups[2] + groups[3]) == [0, 1, 2]
    cfg = TrainerConfig.model_validate({"grad_accum": 2, "epochs": 1})
    assert [len(g) for g in micro_batch_schedule(batches, cfg)] == [2, 1] and planned_steps(3, cfg) == 2
    # fewer micro-batches than grad_accum: one step per epoch, never the same micro-batch twice
    cfg = TrainerConfig.model_validate({"grad_accum": 2, "epochs": 2})
    assert list(micro_batch_schedule([7], cfg)) == [[7], [7]] and planned_steps(1, cfg) == 2
    with pytest.raises(ValueError, match="max_steps"):
        TrainerConfig.model_validate({"epochs": 3, "max_steps": 2})


def _cycle_data(trajectories):
    from trainer.data import CycleData

    return CycleData(
        reward_spec="implicit@1",
        parent_id="base",
        parent_generation=0,
        window_start=None,
        window_end=trajectories[-1].finalized_at,
        used=list(trajectories),
    )


def test_step_budget_shrinks_the_claim_not_the_schedule():
    """Every claimed trajectory is trained; over the budget, the newest task groups are deferred whole."""
    from trainer.training import fit_claim_to_budget, pack_cycle

    trajs = [
        make_trajectory([make_segment([1] * 6, [5, 6, 7])], float(i % 2), task_id=f"task-{i // 2}") for i in range(8)
    ]  # 4 groups of 2, one 10-token row each
    cfg = TrainerConfig.model_validate(
        {"grad_accum": 1, "epochs": 1, "max_steps": 2, "data": {"micro_batch_tokens": 20}}
    )  # 2 rows per micro-batch
    data = _cycle_data(trajs)
    assert fit_claim_to_budget(data, cfg) == 2
    rewards, groups, adv, batches = pack_cycle(data.used, cfg)
    assert [t.group for t in data.used] == ["task-0", "task-0", "task-1", "task-1"]
    assert data.excluded_counts() == {"deferred": 4} and len(batches) == 2
    assert {int(i) for b in batches for i in b.trajectory_index.tolist()} == {0, 1, 2, 3}
    assert adv.tolist() == pytest.approx([-0.5, 0.5, -0.5, 0.5])  # group means over what trains
    assert data.watermark == (data.used[-1].finalized_at, data.used[-1].id)

    unbounded = _cycle_data(trajs)
    cfg = TrainerConfig.model_validate({"grad_accum": 1, "epochs": 2, "data": {"micro_batch_tokens": 20}})
    assert fit_claim_to_budget(unbounded, cfg) == 4
    assert len(unbounded.used) == 8 and not unbounded.excluded


def test_invert_reward_negates_advantages():
    from trainer.training import pack_cycle

    trajs = [make_trajectory([make_segment([1, 2], [5, 6])], r, task_id="t") for r in (1.0, 0.0)]
    cfg = TrainerConfig.model_validate({"invert_reward": True})
    rewards, _, adv, _ = pack_cycle(trajs, cfg)
    assert rewards.tolist() == [-1.0, -0.0] and adv.tolist() == pytest.approx([-0.5, 0.5])


def test_the_placebo_shuffles_rewards_across_trajectories_before_advantages():
    """``data.placebo``: the rewards trained on are a permutation of the real ones, seeded by
    ``seed`` and the trajectory ids; the advantages differ from the real run's."""
    from trainer.training import pack_cycle, placebo_permutation

    trajs = [
        make_trajectory([make_segment([1, 2], [5, 6])], float(i), task_id=f"t{i // 4}") for i in range(16)
    ]  # 4 groups of 4, rewards 0..15
    real_rewards, _, real_adv, _ = pack_cycle(trajs, TrainerConfig.model_validate({"seed": 3}))
    cfg = TrainerConfig.model_validate({"seed": 3, "data": {"placebo": True, "placebo_mode": "across_cycle"}})
    rewards, groups, adv, _ = pack_cycle(trajs, cfg)
    assert sorted(rewards.tolist()) == real_rewards.tolist() and rewards.tolist() != real_rewards.tolist()
    perm = placebo_permutation([t.id for t in trajs], 3)
    assert rewards.tolist() == [float(i) for i in perm]
    assert not torch.allclose(adv, real_adv)
    # Within each group the advantages still sum to zero (Dr. GRPO over the shuffled rewards).
    assert all(abs(float(adv[groups == g].sum())) < 1e-5 for g in groups.unique())
    assert pack_cycle(trajs, cfg)[0].tolist() == rewards.tolist()  # seeded: a rerun draws the same
    other = TrainerConfig.model_validate({"seed": 4, "data": {"placebo": True, "placebo_mode": "across_cycle"}})
    assert pack_cycle(trajs, other)[0].tolist() != rewards.tolist()
    assert list(placebo_permutation([t.id for t in reversed(trajs)], 3)) == list(perm)  # by ids, not order


def test_the_default_placebo_shuffles_within_each_group_and_keeps_its_rewards_and_advantage_sizes():
    """``data.placebo`` with the default ``placebo_mode = "within_group"``: each task group keeps its
    multiset of rewards, so its mean and spread and the size of its advantages are the real run's;
    only which trajectory holds which reward moves (issue 70, item 2)."""
    from trainer.training import pack_cycle, placebo_permutation

    rewards_of = [0.0, 1.0, 1.0, 0.25, 1.0, 0.0, 0.0, 0.0, 0.5, 0.75, 0.0, 1.0, 3.0]  # 3 groups of 4, 1 alone
    trajs = [make_trajectory([make_segment([1, 2], [5, 6])], r, task_id=f"t{i // 4}") for i, r in enumerate(rewards_of)]
    cfg = TrainerConfig.model_validate({"seed": 3, "data": {"placebo": True}})
    assert cfg.data.placebo_mode == "within_group"
    real_rewards, _, real_adv, _ = pack_cycle(trajs, TrainerConfig.model_validate({"seed": 3}))
    moved = False
    for seed in range(8):
        cfg = TrainerConfig.model_validate({"seed": seed, "data": {"placebo": True}})
        rewards, groups, adv, _ = pack_cycle(trajs, cfg)
        for g in groups.unique():
            rows = groups == g
            assert sorted(rewards[rows].tolist()) == sorted(real_rewards[rows].tolist())  # the group's multiset
            assert sorted(adv[rows].tolist()) == pytest.approx(sorted(real_adv[rows].tolist()))  # same step size
        assert rewards[-1] == 3.0  # a trajectory alone in its group keeps its reward
        moved |= rewards.tolist() != real_rewards.tolist()
    assert moved
    ids, keys = [t.id for t in trajs], [t.group for t in trajs]
    perm = placebo_permutation(ids, 3, keys)
    assert all(keys[int(j)] == keys[i] for i, j in enumerate(perm))  # never across groups
    back = placebo_permutation(ids[::-1], 3, keys[::-1])  # by ids and groups, not their order
    assert [ids[::-1][int(j)] for j in back][::-1] == [ids[int(j)] for j in perm]


def test_packing_keeps_every_trainable_token_once():
    segs = [make_segment([1, 2, 3], [4, 5]), make_segment([1] * 10, [6, 7, 8]), make_segment([9], [10])]
    trajs = [make_trajectory([segs[0], segs[1]], 1.0, "a"), make_trajectory([segs[2]], 0.0, None)]
    adv = torch.tensor([0.25, -0.75])
    batches = pack_micro_batches(trajs, adv, micro_batch_tokens=16)
    targets = sorted(t for b in batches for t in b.targets.tolist())
    assert targets == [4, 5, 6, 7, 8, 10]
    for b in batches:
        assert b.input_ids.numel() <= 16 or b.input_ids.shape[0] == 1
        flat = b.input_ids.reshape(-1)
        # the hidden state at index i predicts the token at i + 1 of the same row
        assert torch.equal(flat[b.hidden_index + 1], b.targets)
        for t, a in zip(b.trajectory_index.tolist(), b.advantages.tolist()):
            assert a == pytest.approx(adv[t].item())

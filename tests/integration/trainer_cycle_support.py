"""What the training-cycle tests share: a tiny random policy registered as production, a checkpoint
store of the test's own, and sessions of two-turn trajectories with contrasting rewards
(``test_trainer_cycle.py``, ``test_trainer_cycle_data.py``)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from app.checkpoints.store import CheckpointStore

PROMPT = [1, 40, 41, 42, 43]
CONFIG = {
    "max_steps": 2,
    "grad_accum": 2,
    "epochs": 2,
    "plot_curves": True,
    "data": {"min_new_trajectories": 2, "micro_batch_tokens": 64},
    "loss": {"temperature": 1.0},
    "optim": {"lr": 1e-3},
}


@pytest.fixture(scope="module")
def policy_dir(tmp_path_factory) -> Path:
    from trainer.testing import tiny_policy_dir

    return tiny_policy_dir(tmp_path_factory.mktemp("tiny-policy"), seed=0)


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    return CheckpointStore(tmp_path / "checkpoints")


@pytest.fixture
def production(session, store, policy_dir):
    from trainer.testing import register_checkpoint_dir

    path = register_checkpoint_dir(session, store, policy_dir, "base")
    session.commit()
    return path


def _insert_sessions(session, policy_dir, n_tasks=2, checkpoint_id="base"):
    from transformers import AutoModelForCausalLM

    from trainer.testing import insert_trajectory, make_segment, sequence_logprobs

    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)
    ids = []
    for k in range(n_tasks):
        for completion, reward in (([100 + k, 101, 102, 2], 1.0), ([200 + k, 201, 202, 2], 0.0)):
            behaviour = sequence_logprobs(model, PROMPT + completion)
            # The second turn differs with the outcome: were it the same in every trajectory, its
            # gradients under advantages +A and -A would cancel exactly, and Adam would turn the
            # rounding left of that zero into lr-sized steps that differ between one process and
            # the ranks of an all-reduce (tests/integration/test_trainer_torchrun.py).
            reply = [300, 301] if reward else [301, 300]
            second = make_segment([1, 7, 8], reply, sequence_logprobs(model, [1, 7, 8, *reply]))
            ids.append(
                insert_trajectory(
                    session,
                    segments=[make_segment(PROMPT, completion, behaviour), second],
                    reward=reward,
                    task_id=f"task-{k}",
                    checkpoint_id=checkpoint_id,
                    max_event_seq=100 + len(ids),
                )
            )
    reserved = insert_trajectory(
        session,
        segments=[make_segment(PROMPT, [5, 6], [0] * 7)],
        reward=1.0,
        reserved_for_eval=True,
        checkpoint_id=checkpoint_id,
    )
    session.commit()
    return ids, reserved

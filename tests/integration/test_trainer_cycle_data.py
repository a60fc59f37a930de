"""What a training cycle trains on, against real Postgres on a tiny random model: trajectories
erased or eval tasks mined while it trains, the planted regression (the same data, the reward
negated), the placebo (rewards shuffled within each task group) and groups without reward contrast."""

from __future__ import annotations

import uuid
from datetime import UTC

import numpy as np
import pytest
import torch

from tests.integration.trainer_cycle_support import (  # noqa: F401 (fixtures)
    CONFIG,
    PROMPT,
    _insert_sessions,
    policy_dir,
    production,
    store,
)
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle
from trainer.training import placebo_permutation

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("deletion", ["erasure", "privacy_purge"])
def test_trajectories_deleted_while_the_cycle_trains_leave_the_candidate_flagged(
    session, store, production, policy_dir, monkeypatch, deletion
):
    """The cycle selects its trajectories, then trains for minutes to hours; an erasure (or a session
    turning private, which purges it) that deletes some of them meanwhile cannot flag a checkpoint
    that is not registered yet. Registration must: the candidate is ``trained_on_erased`` (promotion
    refuses it) and an erasure request names it."""
    from sqlalchemy import text

    import trainer.cycle as cycle
    from app.core.db import session_scope
    from app.lifecycle.changes import _check_servable
    from app.models import Checkpoint, Trajectory
    from consumers.erasure import erase_now, purge_private_sessions
    from trainer.cycle import run_cycle

    used, _ = _insert_sessions(session, policy_dir)
    victim = session.get(Trajectory, used[1]).session_id
    real_write, outcome = cycle.write_checkpoint, []

    def delete_then_write(*args, **kwargs):  # after the selection, before the registration
        with session_scope() as s:
            if deletion == "erasure":
                outcome.append(erase_now(s, "user-1", "erasure-while-training"))
            else:
                outcome.append(purge_private_sessions(s, [victim]))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(cycle, "write_checkpoint", delete_then_write)
    result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert result.status == "succeeded", result.detail
    assert outcome
    session.expire_all()
    row = session.get(Checkpoint, result.checkpoint_id)
    assert row.trained_on_erased and row.erasure_flagged_at is not None
    reasons: list[str] = []
    _check_servable(row, None, None, reasons)
    assert "checkpoint trained on data of an erased user" in reasons
    if deletion == "erasure":
        assert outcome[0].trajectories_deleted >= 4 and outcome[0].checkpoints_flagged == []
        flagged = session.execute(
            text("SELECT checkpoints_flagged FROM erasure_request WHERE request_id = 'erasure-while-training'")
        ).scalar_one()
        assert flagged == [result.checkpoint_id]
    else:
        assert session.get(Trajectory, used[1]) is None and session.get(Trajectory, used[0]) is not None


def test_an_eval_task_mined_while_the_cycle_trains_is_retired_at_registration(
    session, store, production, policy_dir, monkeypatch
):
    """Mining during a cycle can hold out a task the cycle already selected (and trains on): the
    gate would then score the candidate on its own training data. Registration retires that task."""
    import uuid
    from datetime import datetime

    import trainer.cycle as cycle
    from app.core.db import session_scope
    from app.models import Checkpoint, EvalTask, EventLog, TrainingCycle, Trajectory
    from evals import mined
    from tests.integration.test_eval_runner_resume import StubTask
    from trainer.cycle import run_cycle

    used, _ = _insert_sessions(session, policy_dir)
    mined_from = session.get(Trajectory, used[0])
    assert mined_from.task_id == "task-0"
    for typ, payload in (
        ("agent.requested", {"request_id": "r", "text": "make f return 1"}),
        (
            "tool.executed",
            {"call_id": "c", "name": "run", "ok": True, "ran_tests": True, "command": "python -m pytest -q"},
        ),
        ("edit.persistence_measured", {"edit_id": "e", "fraction_persisted": 1.0, "delay_s": 60.0}),
    ):
        session.add(
            EventLog(
                event_id=uuid.uuid4(),
                type=typ,
                schema_version=1,
                occurred_at=datetime.now(UTC),
                session_id=mined_from.session_id,
                user_id="user-1",
                org_id="org",
                payload=payload,
            )
        )
    session.commit()
    source = StubTask(
        id="task-0",
        source="test",
        split="train",
        request="spec",
        files={"f.py": "x = 0\n"},
        test_command="python -m pytest -q",
        test_files={"test_f.py": "# hidden\n"},
    )
    monkeypatch.setattr(mined, "source_task", lambda src, task_id: source if task_id == "task-0" else None)
    real_write, reports = cycle.write_checkpoint, []

    def mine_then_write(*args, **kwargs):  # after the selection, before the registration
        with session_scope() as s:
            reports.append(mined.mine_tasks(s))
        return real_write(*args, **kwargs)

    monkeypatch.setattr(cycle, "write_checkpoint", mine_then_write)
    result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert result.status == "succeeded", result.detail
    assert reports and reports[0].mined == ["task-0"]
    session.expire_all()
    assert session.get(EvalTask, "task-0") is None
    row = session.get(Checkpoint, result.checkpoint_id)
    assert row.metrics["eval_tasks_retired"] == ["task-0"]
    assert session.get(TrainingCycle, uuid.UUID(result.cycle_id)).metrics["eval_tasks_retired"] == ["task-0"]
    assert mined.find_contamination(session) == []
    # the next pass does not mine it again: the candidate's lineage has it now
    with session_scope() as s:
        again = mined.mine_tasks(s)
    assert again.mined == [] and session.get(EvalTask, "task-0") is None


def test_planted_regression_trains_on_the_same_data_with_the_reward_negated(session, store, production, policy_dir):
    """``same_data_as`` + ``invert_reward``: a second candidate from the same parent, trained on exactly
    the first one's (already claimed) trajectories, with every advantage's sign flipped."""
    from trainer.cycle import run_cycle

    used, _ = _insert_sessions(session, policy_dir)
    first = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert first.status == "succeeded"
    again = run_cycle(
        TrainerConfig.model_validate({**CONFIG, "data": {**CONFIG["data"], "min_new_trajectories": 1}}), store=store
    )
    assert again.status == "skipped"  # everything new was claimed by the first candidate
    planted = run_cycle(
        TrainerConfig.model_validate(
            {**CONFIG, "invert_reward": True, "data": {**CONFIG["data"], "same_data_as": first.checkpoint_id}}
        ),
        store=store,
        parent_id="base",
    )
    assert planted.status == "succeeded" and planted.parent_id == "base"
    m1, m2 = store.manifest(first.checkpoint_id), store.manifest(planted.checkpoint_id)
    adv1 = {t["id"]: t["advantage"] for t in m1["trajectories"]}
    adv2 = {t["id"]: t["advantage"] for t in m2["trajectories"]}
    assert set(adv2) == set(adv1) == {str(u) for u in used}
    assert all(adv2[k] == pytest.approx(-adv1[k]) and adv1[k] != 0 for k in adv1)
    assert planted.metrics["invert_reward"] is True


def test_a_placebo_cycle_trains_on_shuffled_rewards_and_says_so(session, store, production, policy_dir):
    """``data.placebo`` and ``seed`` through a real cycle: the manifest records both; the advantages
    trained on are those of a permutation of the trajectories' rewards, not of their own."""
    used, _ = _insert_sessions(session, policy_dir, n_tasks=4)
    result = run_cycle(
        TrainerConfig.model_validate({**CONFIG, "seed": 7, "data": {**CONFIG["data"], "placebo": True}}), store=store
    )
    assert result.status == "succeeded" and result.metrics["placebo"] is True
    manifest = store.manifest(result.checkpoint_id)
    assert manifest["placebo"] is True and manifest["seed"] == 7
    entries = manifest["trajectories"]  # the claimed trajectories, in the order they were packed
    assert entries and {t["id"] for t in entries} <= {str(u) for u in used}
    # the default placebo permutes within task groups (data.placebo_mode = "within_group")
    perm = placebo_permutation([uuid.UUID(t["id"]) for t in entries], 7, [t["task_id"] for t in entries])
    assert all(entries[int(j)]["task_id"] == t["task_id"] for t, j in zip(entries, perm))
    shuffled = [entries[i]["reward"] for i in perm]

    def advantages(rewards):
        mean = {
            g: np.mean([r for r, t in zip(rewards, entries) if t["task_id"] == g])
            for g in {t["task_id"] for t in entries}
        }
        return [r - mean[t["task_id"]] for r, t in zip(rewards, entries)]

    assert [t["advantage"] for t in entries] == pytest.approx(advantages(shuffled))
    assert sorted(shuffled) == sorted(t["reward"] for t in entries)


def test_a_group_without_reward_contrast_waits_for_one(session, store, production, policy_dir):
    """``min_group_reward_range``: a task group whose rewards span less is left out with its reason,
    unclaimed, and trains once a later session of its task gives it the contrast."""
    from transformers import AutoModelForCausalLM

    from app.models import CheckpointTrajectory
    from trainer.testing import insert_trajectory, make_segment, sequence_logprobs

    used, _ = _insert_sessions(session, policy_dir)  # two groups with rewards 1 and 0
    model = AutoModelForCausalLM.from_pretrained(policy_dir, dtype=torch.float32)

    def flat(reward):
        completion = [120, 121, 2]
        segment = make_segment(PROMPT, completion, sequence_logprobs(model, PROMPT + completion))
        return insert_trajectory(session, segments=[segment], reward=reward, task_id="task-flat")

    flat_ids = [flat(-1.1), flat(-1.3)]
    session.commit()
    cfg = {**CONFIG, "max_steps": None, "data": {**CONFIG["data"], "min_group_reward_range": 0.5}}
    first = run_cycle(TrainerConfig.model_validate(cfg), store=store)
    assert first.status == "succeeded" and first.num_trajectories == 4
    assert first.excluded["low_reward_contrast"] == 2
    manifest = store.manifest(first.checkpoint_id)
    assert {manifest["excluded"][str(i)] for i in flat_ids} == {"low_reward_contrast"}
    claimed = {
        r.trajectory_id for r in session.query(CheckpointTrajectory).filter_by(checkpoint_id=first.checkpoint_id)
    }
    assert claimed == set(used)

    peer = flat(+0.7)  # a session of the same task that worked
    session.commit()
    second = run_cycle(TrainerConfig.model_validate(cfg), store=store)
    assert second.status == "succeeded" and second.num_trajectories == 3
    trained = {t["id"]: t["advantage"] for t in store.manifest(second.checkpoint_id)["trajectories"]}
    assert set(trained) == {str(i) for i in [*flat_ids, peer]} and trained[str(peer)] > 0

"""A training cycle against real Postgres on a tiny random model: candidate registered atomically
with lineage and outbox message, delta reproduces the serving weights, single-flight lock, crash
safety (SIGKILL during the checkpoint write), and skipping when there is no new data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import uuid
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from app.checkpoints.store import CheckpointStore
from app.models import Trajectory, TrajectorySegment
from app.repositories.events import EventRow, append_events
from trainer.config import TrainerConfig
from trainer.cycle import run_cycle
from trainer.training import placebo_permutation

pytestmark = pytest.mark.integration

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


def test_cycle_produces_registered_candidate(session, store, production, policy_dir):
    from safetensors.torch import load_file

    from app.checkpoints.delta import apply_delta, serving_state_dict
    from app.models import Checkpoint, CheckpointTrajectory, Outbox, TrainingCycle
    from trainer.cycle import run_cycle

    used, reserved = _insert_sessions(session, policy_dir)
    result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert result.status == "succeeded", result.detail
    cid = result.checkpoint_id
    assert cid.startswith("ckpt-") and result.num_trajectories == 4
    session.expire_all()

    row = session.get(Checkpoint, cid)
    assert (row.status, row.parent_id, row.generation, row.reward_spec) == ("candidate", "base", 1, "implicit@4")
    assert row.stable and row.num_trajectories == 4 and row.metrics["steps"] == 2
    assert not row.trained_on_erased and row.erasure_flagged_at is None
    assert {r.trajectory_id for r in session.query(CheckpointTrajectory).filter_by(checkpoint_id=cid)} == set(used)
    cycle = session.get(TrainingCycle, __import__("uuid").UUID(result.cycle_id))
    assert cycle.status == "succeeded" and cycle.checkpoint_id == cid and cycle.watermark_seq == 103
    outbox = session.query(Outbox).filter_by(key=cid).one()
    assert outbox.event_type == "checkpoint.created" and outbox.payload["parent_id"] == "base"

    # the directory: STABLE, intact, complete, lineage in the manifest
    path = store.stable_path(cid)
    assert store.verify(cid) == []
    for name in (
        "config.json",
        "model.safetensors",
        "trainer_config.json",
        "metrics.json",
        "curves.png",
        "delta.zst",
        "manifest.json",
    ):
        assert (path / name).is_file(), name
    manifest = store.manifest(cid)
    assert manifest["parent_id"] == "base" and manifest["kind"] == "trained"
    assert {t["id"] for t in manifest["trajectories"]} == {str(u) for u in used}
    assert manifest["excluded"] == {str(reserved): "reserved_for_eval"}
    assert all(t["event_ids"] and t["offsets"] for t in manifest["trajectories"])
    assert TrainerConfig.model_validate_json((path / "trainer_config.json").read_text()).max_steps == 2
    metrics = json.loads((path / "metrics.json").read_text())
    assert len(metrics["history"]) == 2 and metrics["data"]["groups"] == 2
    assert manifest["stopped_early"] is None and metrics["stopped_early"] is None and manifest["pi_old"] == "recompute"
    assert manifest["placement"] == metrics["placement"] and manifest["placement"]["precision"] in ("bf16", "fp32")

    # weights moved, and the delta reproduces the candidate's serving weights bit-exactly
    parent_state = load_file(production / "model.safetensors")
    child_state = load_file(path / "model.safetensors")
    assert any(not torch.equal(parent_state[k], child_state[k]) for k in child_state)
    rebuilt = apply_delta(parent_state, path / "delta.zst")
    expected = serving_state_dict(child_state)
    assert all(torch.equal(rebuilt[k].view(torch.int16), expected[k].view(torch.int16)) for k in expected)

    # nothing new: the next cycle skips and leaves the watermark alone
    again = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert again.status == "skipped" and again.num_trajectories == 0
    assert again.excluded == {"earlier_cycle": 4, "reserved_for_eval": 1}


def test_the_cycle_span_links_to_the_producer_spans_of_the_events_it_trains_on(
    session, store, production, policy_dir, monkeypatch
):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)
    monkeypatch.setattr("trainer.cycle._tracer", provider.get_tracer("flywheel.trainer"))
    used, reserved = _insert_sessions(session, policy_dir)
    # each trajectory's events as stored by the consumer, emitted by one producer span per trajectory
    spans, rows = {}, []
    for tid in [*used, reserved]:
        trace_id, span_id = f"{tid.int:032x}", f"{(tid.int >> 64) or 1:016x}"
        spans[str(tid)] = (int(trace_id, 16), int(span_id, 16))
        traj = session.get(Trajectory, tid)
        for seg in session.scalars(select(TrajectorySegment).where(TrajectorySegment.trajectory_id == tid)):
            rows += [
                EventRow(
                    e,
                    "model.responded",
                    1,
                    datetime.now(UTC),
                    traj.session_id,
                    traj.user_id,
                    "org",
                    "{}",
                    None,
                    None,
                    None,
                    trace_id,
                    None,
                    span_id,
                )
                for e in seg.event_ids
            ]
    append_events(session, rows)
    session.commit()

    result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert result.status == "succeeded", result.detail
    (cycle,) = [s for s in exporter.get_finished_spans() if s.name == "trainer.cycle"]
    linked = {link.attributes["flywheel.trajectory_id"]: link.context for link in cycle.links}
    assert set(linked) == {str(u) for u in used}  # what it trained on; not the reserved trajectory
    assert all((c.trace_id, c.span_id) == spans[tid] for tid, c in linked.items())
    assert cycle.attributes["flywheel.producer_spans.linked"] == 4


def test_a_cycle_the_update_watch_stops_registers_its_candidate_with_the_reason(session, store, production, policy_dir):
    from app.models import Checkpoint
    from trainer.cycle import run_cycle

    _insert_sessions(session, policy_dir)
    config = {**CONFIG, "precision": "fp32", "max_kl_per_token": 1e-9, "optim": {"lr": 1e-2}}
    result = run_cycle(TrainerConfig.model_validate(config), store=store)
    assert result.status == "succeeded", result.detail
    manifest = store.manifest(result.checkpoint_id)
    stopped = manifest["stopped_early"]
    assert stopped["step"] == 2 and "max_kl_per_token" in stopped["reason"]
    assert manifest["placement"]["precision"] == "fp32"
    session.expire_all()
    row = session.get(Checkpoint, result.checkpoint_id)
    assert row.metrics["stopped_early"] == stopped and row.metrics["planned_steps"] == 2
    assert manifest["not_trained"] == [] and row.metrics["untrained_trajectories"] == 0  # step 1 was epoch 1
    history = json.loads((store.stable_path(result.checkpoint_id) / "metrics.json").read_text())["history"]
    assert len(history) == 2 and history[1]["skipped_step"] and not history[0]["skipped_step"]


def test_a_stopped_cycle_names_what_it_did_not_train_on(session, store, production, policy_dir):
    from app.models import Checkpoint, CheckpointTrajectory
    from trainer.cycle import run_cycle

    used, _ = _insert_sessions(session, policy_dir)
    # one micro-batch a step, one epoch: 2+ steps; a KL stop no step after the first can pass
    config = {
        **CONFIG,
        "max_steps": None,
        "epochs": 1,
        "grad_accum": 1,
        "precision": "fp32",
        "max_kl_per_token": 1e-9,
        "data": {**CONFIG["data"], "micro_batch_tokens": 24},
        "optim": {"lr": 1e-2},
    }
    result = run_cycle(TrainerConfig.model_validate(config), store=store)
    assert result.status == "succeeded", result.detail
    manifest = store.manifest(result.checkpoint_id)
    assert manifest["stopped_early"]["step"] == 2
    claimed = {t["id"] for t in manifest["trajectories"]}
    not_trained = set(manifest["not_trained"])
    assert claimed == {str(u) for u in used}  # the whole claim: they set the trained ones' baselines
    assert not_trained and not_trained < claimed
    session.expire_all()
    row = session.get(Checkpoint, result.checkpoint_id)
    assert row.metrics["untrained_trajectories"] == len(not_trained) and row.metrics["planned_steps"] > 2
    lineage = session.query(CheckpointTrajectory).filter_by(checkpoint_id=result.checkpoint_id)
    assert {str(r.trajectory_id) for r in lineage} == claimed


def test_second_cycle_is_locked_out(session, store, production, policy_dir, database_url):
    import psycopg

    from app.core.locks import AdvisoryLock
    from trainer.cycle import run_cycle

    _insert_sessions(session, policy_dir)
    with psycopg.connect(database_url, autocommit=True) as other:
        other.execute("SELECT pg_advisory_lock(%s)", (AdvisoryLock.CYCLE,))
        result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
        assert result.status == "locked"
        # Unlock before closing: a closed connection's locks are released by its backend
        # some time after the client has gone, which a cycle started at once can still see.
        other.execute("SELECT pg_advisory_unlock(%s)", (AdvisoryLock.CYCLE,))
    assert store.list_stable() == ["base"]
    assert run_cycle(TrainerConfig.model_validate(CONFIG), store=store).status == "succeeded"


KILL_SCRIPT = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    import trainer.checkpointing as ck
    from app.checkpoints.store import CheckpointStore
    from trainer.config import TrainerConfig
    from trainer.cycle import run_cycle

    original = ck.write_delta
    def write_delta_then_hang(*args, **kwargs):
        stats = original(*args, **kwargs)
        print("WRITING", flush=True)
        time.sleep(120)
        return stats
    ck.write_delta = write_delta_then_hang
    run_cycle(TrainerConfig.model_validate_json(sys.argv[2]), store=CheckpointStore(Path(sys.argv[1])))
""")


def test_kill_during_checkpoint_write_leaves_nothing_visible(session, store, production, policy_dir, database_url):
    from app.models import Checkpoint, TrainingCycle
    from trainer.cycle import run_cycle

    _insert_sessions(session, policy_dir)
    env = {**os.environ, "FLYWHEEL_DATABASE_URL": database_url}
    proc = subprocess.Popen(
        [sys.executable, "-c", KILL_SCRIPT, str(store.root), json.dumps(CONFIG)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stdout.readline()
        assert line.strip() == "WRITING", proc.stderr.read()
        staged = list((store.root / ".staging").iterdir())
        assert len(staged) == 1 and (staged[0] / "model.safetensors").exists()
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    # nothing visible: no new STABLE directory, no candidate row; the cycle row is left running
    assert store.list_stable() == ["base"]
    session.expire_all()
    assert session.query(Checkpoint).count() == 1
    assert [c.status for c in session.query(TrainingCycle)] == ["running"]

    result = run_cycle(TrainerConfig.model_validate(CONFIG), store=store)
    assert result.status == "succeeded" and result.metrics["interrupted_cycles"] == 1
    assert not any((store.root / ".staging").iterdir())
    assert store.list_stable() == sorted(["base", result.checkpoint_id])
    session.expire_all()
    assert sorted(c.status for c in session.query(TrainingCycle)) == ["failed", "succeeded"]


def test_unregistered_trained_directory_is_swept(session, store, production):
    from trainer.cycle import sweep_unregistered

    with store.writer("ckpt-orphan") as staging:
        (staging / "manifest.json").write_text(
            json.dumps({"kind": "trained", "cycle_id": str(__import__("uuid").uuid4())})
        )
    (store.root / ".staging" / "debris").mkdir(parents=True)
    assert sweep_unregistered(store, session) == ["ckpt-orphan"]
    assert store.list_stable() == ["base"] and not (store.root / "ckpt-orphan").exists()
    assert not any((store.root / ".staging").iterdir())


def test_cli_dry_run_and_once(session, store, production, policy_dir, monkeypatch):
    from typer.testing import CliRunner

    from ops.cli import app

    monkeypatch.setenv("FLYWHEEL_CHECKPOINT_DIR", str(store.root))
    _insert_sessions(session, policy_dir, n_tasks=1)
    runner = CliRunner()
    dry = runner.invoke(app, ["train", "--dry-run", "--json", "--min-new", "1"])
    assert dry.exit_code == 0, dry.output
    out = json.loads(dry.output.strip().splitlines()[-1])
    assert out["status"] == "skipped" and out["num_trajectories"] == 2 and store.list_stable() == ["base"]
    config = store.root.parent / "trainer.toml"
    config.write_text("max_steps = 1\ngrad_accum = 1\n[data]\nmin_new_trajectories = 1\n[optim]\nlr = 1e-4\n")
    once = runner.invoke(app, ["train", "--once", "--config", str(config), "--no-progress"])
    assert once.exit_code == 0, once.output
    assert "succeeded: candidate ckpt-" in once.output and "excluded: reserved_for_eval=1" in once.output
    bad = runner.invoke(app, ["train", "--once", "--config", str(config), "--lr", "5"])
    assert bad.exit_code != 0


def test_celery_task_is_registered():
    pytest.importorskip("app.worker.celery_app")
    import trainer.tasks  # noqa: F401
    from app.worker.celery_app import celery_app

    assert "flywheel.trainer.run_cycle" in celery_app.tasks


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
    perm = placebo_permutation([uuid.UUID(t["id"]) for t in entries], 7)
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

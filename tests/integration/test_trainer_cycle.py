"""A training cycle against real Postgres on a tiny random model: candidate registered atomically
with lineage and outbox message, weights moved and no delta written, single-flight lock, crash
safety (SIGKILL during the checkpoint write), and skipping when there is no new data."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from datetime import UTC, datetime

import pytest
import torch
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from app.models import Trajectory, TrajectorySegment
from app.repositories.events import EventRow, append_events
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

pytestmark = pytest.mark.integration


def test_cycle_produces_registered_candidate(session, store, production, policy_dir):
    from safetensors.torch import load_file

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
        "manifest.json",
    ):
        assert (path / name).is_file(), name
    assert not (path / "delta.zst").exists()  # serving reloads whole folders (docs/serving.md)
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

    # weights moved
    parent_state = load_file(production / "model.safetensors")
    child_state = load_file(path / "model.safetensors")
    assert any(not torch.equal(parent_state[k], child_state[k]) for k in child_state)

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

    original = ck.plot_curves
    def plot_curves_then_hang(*args, **kwargs):
        original(*args, **kwargs)
        print("WRITING", flush=True)
        time.sleep(120)
    ck.plot_curves = plot_curves_then_hang
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

"""Mining held-out tasks from production trajectories, and the contamination check (real Postgres)."""

from __future__ import annotations

import uuid
from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy import select
from typer.testing import CliRunner

from app.core.db import session_scope
from app.models import CheckpointTrajectory, EvalTask, EventLog, TaskEnvironment, Trajectory
from app.repositories.checkpoints import add_checkpoint
from evals import mined
from tests.integration.test_eval_runner_resume import StubTask

pytestmark = pytest.mark.integration

T0 = datetime(2026, 11, 1, tzinfo=UTC)
SOURCE = {
    tid: StubTask(
        id=tid,
        source="dataframebench",
        split="train",
        request=f"full spec of {tid}",
        files={"solution.py": "def f():\n    pass\n"},
        test_command="python -m pytest -q",
        test_files={"test_solution.py": f"# hidden tests of {tid}\n"},
        reference_files={"solution.py": "def f():\n    return 1\n"},
    )
    for tid in ("dfb/A", "dfb/B", "dfb/C", "dfb/D")
}


def add_session(
    s,
    n: int,
    task_id: str,
    *,
    source: str = "dataframebench",
    persisted: list[float] = (0.9,),
    ran_tests: bool = True,
    status: str = "finalized",
    request: str = "make f return 1",
) -> Trajectory:
    sid = f"sess-{n}"
    traj = Trajectory(
        id=uuid.uuid4(),
        session_id=sid,
        user_id=f"u{n}",
        org_id="o",
        task_id=task_id,
        task_source=source,
        status=status,
        ran_tests=ran_tests,
        request_text=request,
        finalized_at=T0 + timedelta(minutes=n) if status == "finalized" else None,
        test_commands=["python -m pytest -q"] if ran_tests else [],
    )
    s.add(traj)
    events = [("agent.requested", {"request_id": "r", "text": request})]
    if ran_tests:
        events.append(
            (
                "tool.executed",
                {"call_id": "c", "name": "run", "ok": True, "ran_tests": True, "command": "python -m pytest -q"},
            )
        )
    events += [
        ("edit.persistence_measured", {"edit_id": f"e{i}", "fraction_persisted": f, "delay_s": 60.0})
        for i, f in enumerate(persisted)
    ]
    for typ, payload in events:
        s.add(
            EventLog(
                event_id=uuid.uuid4(),
                type=typ,
                schema_version=1,
                occurred_at=T0,
                session_id=sid,
                user_id=f"u{n}",
                org_id="o",
                payload=payload,
            )
        )
    s.flush()
    return traj


@pytest.fixture
def sessions(db, monkeypatch):
    monkeypatch.setattr(
        mined, "source_task", lambda source, task_id: SOURCE.get(task_id) if source == "dataframebench" else None
    )
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="old", path="/x/old")
        t = {
            "late_A": add_session(s, 0, "dfb/A", persisted=[0.2]),  # not persisted, same task as good
            "good": add_session(s, 1, "dfb/A", persisted=[1.0, 0.8]),
            "dup": add_session(s, 2, "dfb/A", request="Make  F return 1 "),  # same content, other session
            "unpersisted": add_session(s, 3, "dfb/B", persisted=[0.5, 0.4]),
            "no_tests": add_session(s, 4, "dfb/C", ran_tests=False),
            "product": add_session(s, 5, "repo-x/issue-9", source="product"),
            "provisional": add_session(s, 6, "dfb/A", status="provisional"),
            "trained": add_session(s, 7, "dfb/D"),
            "no_signal": add_session(s, 8, "dfb/B", persisted=[]),
        }
        s.add(CheckpointTrajectory(checkpoint_id="old", trajectory_id=uuid.uuid4(), user_id="u", task_id="dfb/D"))
    return {k: v.id for k, v in t.items()}


def test_mining_selects_dedups_and_reserves(sessions):
    with session_scope() as s:
        report = mined.mine_tasks(s, min_persistence=0.8)
    assert report.mined == ["dfb/A"]
    assert report.examined == 8  # the provisional one is not eligible
    assert dict(report.skipped) == {
        "edits_not_persisted": 2,
        "duplicate": 1,
        "no_tests": 1,
        "no_source_task": 1,
        "already_trained": 1,
        "no_persistence": 1,
    }
    with session_scope() as s:
        (task,) = s.scalars(select(EvalTask)).all()
        assert (task.suite, task.source_trajectory_id, task.source_session_id) == ("mined", sessions["good"], "sess-1")
        assert task.spec["request"] == "make f return 1"  # the session's request, not the source's spec
        assert task.spec["test_files"] == SOURCE["dfb/A"].test_files  # the tests the session ran
        assert task.spec["metadata"]["source_task_id"] == "dfb/A"
        reserved = {t.id for t in s.scalars(select(Trajectory).where(Trajectory.reserved_for_eval))}
    # Every trajectory on the mined task (even the provisional and the unpersisted ones) is held out.
    assert reserved == {sessions[k] for k in ("late_A", "good", "dup", "provisional")}
    with session_scope() as s:
        again = mined.mine_tasks(s)
    assert again.mined == [] and again.examined == 5


def test_content_hash_normalizes_the_request():
    a = mined.content_hash("Make f  return 1\n", {"a.py": "x"}, "pytest", {})
    assert a == mined.content_hash("make F return 1", {"a.py": "x"}, "pytest", {})
    assert a != mined.content_hash("make f return 2", {"a.py": "x"}, "pytest", {})
    assert a != mined.content_hash("make f return 1", {"a.py": "y"}, "pytest", {})


def test_contamination_check_finds_eval_tasks_in_lineage_and_manifests(sessions):
    from ops.cli import app

    with session_scope() as s:
        mined.mine_tasks(s)
        assert mined.find_contamination(s) == []
    cli = CliRunner()
    assert cli.invoke(app, ["eval", "contamination", "--no-static"]).exit_code == 0
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="leaky", path="/x/leaky")
        s.add(
            CheckpointTrajectory(checkpoint_id="leaky", trajectory_id=sessions["good"], user_id="u1", task_id="dfb/A")
        )
        add_checkpoint(
            s,
            checkpoint_id="manifest-only",
            path="/x/m",
            manifest={
                "trajectories": [{"trajectory_id": str(sessions["good"]), "seq": 3}],
                "data": {"task_ids": ["HumanEval/7"]},
            },
        )
        s.add(CheckpointTrajectory(checkpoint_id="old", trajectory_id=uuid.uuid4(), user_id="u", task_id="HumanEval/3"))
    with session_scope() as s:
        found = {
            (c.checkpoint_id, c.task_id, c.via) for c in mined.find_contamination(s, ["HumanEval/3", "HumanEval/7"])
        }
    assert found == {
        ("leaky", "dfb/A", "checkpoint_trajectory.task_id"),
        ("leaky", "dfb/A", "checkpoint_trajectory.trajectory_id"),
        ("manifest-only", "dfb/A", "manifest"),
        ("manifest-only", "HumanEval/7", "manifest"),
        ("old", "HumanEval/3", "checkpoint_trajectory.task_id"),
    }
    result = cli.invoke(app, ["eval", "contamination", "--no-static"])
    assert result.exit_code == 1 and "CONTAMINATED leaky: dfb/A" in result.output


def test_mined_tasks_load_as_the_mined_suite(sessions):
    from evals.tasks import load_tasks
    from evals.tasks.model import Task

    with session_scope() as s:
        mined.mine_tasks(s)
    assert load_tasks("mined", "test") == []  # in the suite only once an environment verified for it
    with session_scope() as s:
        for verified in (False, True):
            s.add(
                TaskEnvironment(
                    env_hash=f"h{verified}", task_key="k", task_id="dfb/A", source="mined", eval_task_id="dfb/A",
                    origin="fallback", proposal={"dependencies": [], "files": {}}, verified=verified,
                )
            )  # fmt: skip
    (task,) = load_tasks("mined", "test")
    assert isinstance(task, Task) and task.id == "dfb/A" and task.source == "mined"
    assert task.request == "make f return 1" and task.reference_files == SOURCE["dfb/A"].reference_files


def test_simulated_sessions_resolve_their_source_task():
    from evals.tasks import load_tasks

    train = load_tasks("dataframebench", "train", limit=1)[0]
    assert mined.source_task("dataframebench", train.id) == train
    assert mined.source_task("humaneval", "HumanEval/3").id == "HumanEval/3"
    assert mined.source_task("product", "repo/issue") is None
    assert mined.source_task("dataframebench", "DFB/nope") is None


def test_an_erasure_committed_while_mining_runs_is_skipped_not_mined(sessions, monkeypatch):
    """Mining reads the trajectories, then examines them one by one; an erasure that commits in
    between deletes a session mining then reaches. Mining must skip it (no task from an erased
    session, no crash), not insert its task and fail on the vanished row."""
    from consumers.erasure import erase_now

    erased = []

    def erase_then_look_up(source, task_id):
        if not erased:  # the first qualifying session is "good", user u1
            with session_scope() as other:
                erased.append(erase_now(other, "u1", "erasure-while-mining"))
        return SOURCE.get(task_id) if source == "dataframebench" else None

    monkeypatch.setattr(mined, "source_task", erase_then_look_up)
    with session_scope() as s:
        report = mined.mine_tasks(s, min_persistence=0.8)
    assert erased and erased[0].trajectories_deleted == 1
    assert report.skipped["erased"] == 1
    assert report.mined == ["dfb/A"]  # from the duplicate session of the same task instead
    with session_scope() as s:
        (task,) = s.scalars(select(EvalTask)).all()
        assert task.source_trajectory_id == sessions["dup"] and task.source_session_id == "sess-2"
        assert s.get(Trajectory, sessions["good"]) is None


def test_a_trajectory_an_uncommitted_erasure_is_deleting_is_skipped_without_waiting(sessions, db):
    """An erasure (or a privacy purge) is deleting a session's trajectory and has not committed:
    mining neither waits for it (which could deadlock with an erasure of several of the user's
    trajectories) nor mines it."""
    import psycopg
    from sqlalchemy import text

    with psycopg.connect(db) as eraser:
        eraser.execute("DELETE FROM trajectory WHERE id = %s", (sessions["good"],))  # held, uncommitted
        with session_scope() as s:
            s.execute(text("SET LOCAL lock_timeout = '3s'"))  # waiting would fail the test, not hang it
            report = mined.mine_tasks(s, min_persistence=0.8)
        eraser.rollback()
    assert report.skipped["erased"] == 1 and report.mined == ["dfb/A"]
    with session_scope() as s:
        (task,) = s.scalars(select(EvalTask)).all()
        assert task.source_trajectory_id == sessions["dup"]


def test_beats_refresh_mines_verifies_environments_and_reports_contamination(db, tiny_model_dir):
    """``flywheel.evals.refresh_mined_suite`` end to end on a real database, a real (tiny, random)
    model proposing environments and the sandbox verifying them: a persisted simulated session on a
    ``functions`` task becomes a mined task with a verified environment (the resolver's, as the tiny
    model proposes nothing usable), so the gate's suite holds it; a checkpoint that later trains on it
    is reported as contaminated; a second refresh at the same time is turned away."""
    from evals.mined_refresh import refresh_mined_suite
    from evals.store import advisory_lock
    from evals.tasks import load_tasks
    from serving.reference_engine import ReferenceEngine

    task_id = "FN/arithmetic/0"
    with session_scope() as s:
        add_session(s, 1, task_id, source="functions")
    result = refresh_mined_suite(lambda: ReferenceEngine(tiny_model_dir, num_threads=1), max_tokens=16)
    assert result["status"] == "done" and result["mined"] == [task_id] and result["contaminated"] == []
    assert result["environments"]["tasks"] == 1
    (task,) = load_tasks("mined", "test")
    assert task.id == task_id
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="late", path="/x/late")
        s.add(CheckpointTrajectory(checkpoint_id="late", trajectory_id=uuid.uuid4(), user_id="u", task_id=task_id))
    with advisory_lock("mined-suite", "refresh"):
        assert refresh_mined_suite(lambda: ReferenceEngine(tiny_model_dir, num_threads=1)) == {"status": "busy"}
    again = refresh_mined_suite(lambda: ReferenceEngine(tiny_model_dir, num_threads=1), max_tokens=16)
    assert again["mined"] == [] and again["environments"]["cached"] == 1
    assert [(c["checkpoint_id"], c["task_id"]) for c in again["contaminated"]] == [("late", task_id)]

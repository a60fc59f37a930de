"""Fixtures and seeding helpers shared by the promotion API tests (imported by them; no tests here).

Checkpoint rows are inserted directly, each with a real STABLE directory made by
``CheckpointStore.writer`` (manifest naming its parent), and gate
decisions / eval results as the evals area would write them.
"""

from __future__ import annotations

import json
import socket
import threading
import time
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from app.checkpoints.store import CheckpointStore
from app.models import Checkpoint, EvalResult, EvalRun, GateDecision

# A 1x1 PNG (what the evals' report figure is, in miniature).
PNG_1PX = bytes.fromhex(
    "89504e470d0a1a0a0000000d49484452000000010000000108060000001f15c489"
    "0000000d4944415478da63f8cfc0f01f0005000201a5f6c4e80000000049454e44ae426082"
)


def write_checkpoint_dir(store: CheckpointStore, checkpoint_id: str, parent_id: str | None) -> Path:
    """A STABLE checkpoint directory with a manifest."""
    with store.writer(checkpoint_id) as staging:
        (staging / "config.json").write_text(json.dumps({"model_type": "llama"}))
        (staging / "manifest.json").write_text(
            json.dumps(
                {
                    "checkpoint_id": checkpoint_id,
                    "parent_id": parent_id,
                    "reward_spec": "implicit@1",
                    "data_window": {"start": "2026-11-20T00:00:00+00:00", "end": "2026-11-20T05:00:00+00:00"},
                }
            )
        )
    return store.stable_path(checkpoint_id)


def seed_checkpoint(
    session,
    store: CheckpointStore,
    checkpoint_id: str,
    *,
    status: str = "candidate",
    parent_id: str | None = None,
    generation: int = 0,
    stable_dir: bool = True,
    created_at: datetime | None = None,
) -> Checkpoint:
    """Insert a checkpoint row (and its STABLE directory) and commit."""
    path = write_checkpoint_dir(store, checkpoint_id, parent_id) if stable_dir else store.path(checkpoint_id)
    row = Checkpoint(
        id=checkpoint_id,
        parent_id=parent_id,
        status=status,
        path=str(path),
        stable=stable_dir,
        generation=generation,
        reward_spec="implicit@1" if parent_id else None,
        manifest={
            "parent_id": parent_id,
            "reward_spec": "implicit@1",
            "data_window": {"start": "2026-11-20T00:00:00+00:00", "end": "2026-11-20T05:00:00+00:00"},
        },
        metrics={"loss": 0.42, "kl": 0.01} if parent_id else {},
        num_trajectories=12 if parent_id else 0,
    )
    if created_at is not None:
        row.created_at = created_at
    session.add(row)
    session.commit()
    return row


def seed_gate(
    session,
    candidate_id: str,
    production_id: str,
    *,
    passed: bool,
    reasons: list[str] | None = None,
    report_path: str | None = None,
    status: str | None = None,
    report: dict | None = None,
) -> GateDecision:
    """Insert a gate decision (and move the candidate to gate_passed/gate_failed, its ``decision``
    column to the report's decision, else pass or fail) and commit: a fixture, so it writes the rows
    itself rather than through ``app.lifecycle.gating`` (a test may seed any status)."""
    decision = (report or {}).get("decision") or ("pass" if passed else "fail")
    gate = GateDecision(
        id=uuid.uuid4(),
        candidate_id=candidate_id,
        production_id=production_id,
        passed=passed,
        decision=decision,
        reasons=reasons or ([] if passed else ["humaneval regressed: -0.20 (CI -0.31..-0.09)"]),
        report=report if report is not None else {"policy": "no-regression@1"},
        report_path=report_path,
    )
    session.add(gate)
    row = session.get(Checkpoint, candidate_id)
    row.status = status or ("gate_passed" if passed else "gate_failed")
    row.decision = decision
    session.commit()
    return gate


def seed_eval_run(session, checkpoint_id: str, suite: str, results: dict[str, list[bool]]) -> EvalRun:
    """A succeeded eval run with per-task sample results; commit."""
    run = EvalRun(
        id=uuid.uuid4(),
        checkpoint_id=checkpoint_id,
        suite=suite,
        suite_version="1",
        status="succeeded",
        finished_at=datetime.now(UTC),
    )
    session.add(run)
    session.flush()
    for task_id, samples in results.items():
        for i, passed in enumerate(samples):
            session.add(EvalResult(run_id=run.id, task_id=task_id, sample_index=i, passed=passed))
    session.commit()
    return run


def make_token(session, role: str, name: str | None = None) -> str:
    """Create a token (committed) and return the plaintext."""
    from app.repositories.tokens import create_token

    _, raw = create_token(session, name=name or f"{role}-{uuid.uuid4().hex[:6]}", role=role, actor="test")
    session.commit()
    return raw


def auth(token: str) -> dict[str, str]:
    """The Authorization header for a token."""
    return {"Authorization": f"Bearer {token}"}


@pytest.fixture
def store(tmp_path, monkeypatch) -> CheckpointStore:
    """A checkpoint store (and report dir) under the test's tmp dir, exported through settings."""
    monkeypatch.setenv("FLYWHEEL_CHECKPOINT_DIR", str(tmp_path / "checkpoints"))
    monkeypatch.setenv("FLYWHEEL_REPORT_DIR", str(tmp_path / "reports"))
    (tmp_path / "reports").mkdir()
    from app.core.settings import get_settings

    get_settings.cache_clear()  # the app may have read settings before this fixture ran
    return CheckpointStore(tmp_path / "checkpoints")


@pytest.fixture
def base(session, store) -> Checkpoint:
    """The base model registered as production (as ``flywheel model init`` does)."""
    return seed_checkpoint(
        session, store, "base", status="production", created_at=datetime.now(UTC) - timedelta(days=1)
    )


@pytest.fixture
def gated(session, store, base) -> Checkpoint:
    """A candidate trained from base whose gate passed against base."""
    row = seed_checkpoint(session, store, "ckpt-0001", parent_id="base", generation=1)
    seed_gate(session, row.id, "base", passed=True)
    return row


@pytest.fixture
def client(db):
    """An httpx client (Starlette's TestClient) on a fresh app, lifespan included."""
    from fastapi.testclient import TestClient

    from app.api.main import create_app

    with TestClient(create_app()) as c:
        yield c


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def live_server(db):
    """The app served by uvicorn on a free loopback port in a thread; yields the base URL."""
    import uvicorn

    from app.api.main import create_app

    port = _free_port()
    server = uvicorn.Server(uvicorn.Config(create_app(), host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def lifecycle_topic(topics) -> str:
    """A fresh lifecycle topic on the test broker, with settings re-read so the outbox targets it."""
    from app.core.settings import get_settings

    get_settings.cache_clear()
    return topics["lifecycle"]

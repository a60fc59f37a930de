"""The serving side of a canary: the engine router's sticky per-user pick, and the follower that
starts and stops the canary engine from lifecycle messages (deduplicated, newest wins, restored
after a restart from serving.json)."""

from __future__ import annotations

import json

import pytest

from app.checkpoints.store import CheckpointStore
from app.lifecycle.assignment import assign_arm
from app.lifecycle.messages import CanaryStarted, CanaryStopped
from app.lifecycle.serving_state import read_serving_state
from serving.canary import ActiveCanary, CanaryFollower, EngineRouter
from serving.watcher import ProductionFollower
from tests.unit.test_api_units import RecordingEngine

USERS = [f"user-{i:03d}" for i in range(200)]


class ClosableEngine(RecordingEngine):
    def __init__(self, checkpoint_id: str) -> None:
        super().__init__(checkpoint_id)
        self.closed = False

    def close(self) -> None:
        self.closed = True


def test_router_sends_each_user_to_one_arm_until_the_canary_stops():
    prod, cand = ClosableEngine("base"), ClosableEngine("ckpt-1")
    router = EngineRouter(prod)
    assert {router.engine_for(u) for u in USERS} == {prod}
    router.start(ActiveCanary(canary_id="c-1", checkpoint_id="ckpt-1", fraction=0.25), cand)
    picks = {u: router.engine_for(u) for u in USERS}
    assert all((picks[u] is cand) == (assign_arm(u, "c-1", 0.25) == "canary") for u in USERS)
    assert 20 < sum(e is cand for e in picks.values()) < 80
    assert all(router.engine_for(u) is picks[u] for u in USERS)  # sticky
    assert router.arm_for(next(u for u in USERS if picks[u] is cand)) == "canary"
    router.stop()
    assert cand.closed and {router.engine_for(u) for u in USERS} == {prod}


@pytest.fixture
def store(tmp_path) -> CheckpointStore:
    store = CheckpointStore(tmp_path / "ckpts")
    for cid in ("base", "ckpt-1", "ckpt-2"):
        with store.writer(cid) as d:
            (d / "manifest.json").write_text(json.dumps({"parent_id": None}))
    return store


def _msg(kind: str, canary_id: str, cid: str, outbox_id: int, fraction: float = 0.5) -> CanaryStarted | CanaryStopped:
    """A canary change as the lifecycle topic delivers it (parsed, with the relay's ``outbox_id``)."""
    if kind == "canary.started":
        return CanaryStarted(
            event_id=f"e-{outbox_id}",
            canary_id=canary_id,
            checkpoint_id=cid,
            fraction=fraction,
            production_id="base",
            outbox_id=outbox_id,
        )
    return CanaryStopped(event_id=f"e-{outbox_id}", canary_id=canary_id, checkpoint_id=cid, outbox_id=outbox_id)


def test_follower_applies_the_newest_canary_change_once_and_survives_a_restart(store, tmp_path):
    built: list[str] = []

    def factory(cid, path):
        assert (path / "STABLE").exists()
        built.append(cid)
        return ClosableEngine(cid)

    prod = RecordingEngine("base")
    canary = CanaryFollower(EngineRouter(prod), store=store, factory=factory)
    follower = ProductionFollower(prod, store=store, home=tmp_path, canary=canary)
    # started then stopped in one batch: the newest (stopped) says what serves, nothing is built
    follower.handle_batch(
        [(_msg("canary.started", "c-1", "ckpt-1", 3), None), (_msg("canary.stopped", "c-1", "ckpt-1", 4), None)]
    )
    assert built == [] and canary.router.active is None
    follower.handle_batch([(_msg("canary.started", "c-2", "ckpt-2", 7, fraction=0.1), None)])
    assert built == ["ckpt-2"] and canary.router.active.canary_id == "c-2"
    follower.handle_batch(
        [
            (_msg("canary.started", "c-2", "ckpt-2", 7, fraction=0.1), None),  # redelivered
            (_msg("canary.stopped", "c-1", "ckpt-1", 4), None),
        ]
    )  # stale
    assert built == ["ckpt-2"] and canary.router.active.canary_id == "c-2"
    assert prod.calls == []  # canary changes never move the production engine
    saved = read_serving_state(tmp_path)
    assert saved["canary"]["canary_id"] == "c-2" and saved["applied_canary_outbox_id"] == 7
    assert saved["checkpoint_id"] == "base"

    restarted = CanaryFollower(EngineRouter(prod), store=store, factory=factory)
    again = ProductionFollower(prod, store=store, home=tmp_path, canary=restarted)
    assert built == ["ckpt-2", "ckpt-2"] and restarted.router.active.fraction == 0.1
    assert not restarted.accept(_msg("canary.started", "c-2", "ckpt-2", 7))
    stopped_engine = restarted.router.canary_engine
    again.handle_batch([(_msg("canary.stopped", "c-2", "ckpt-2", 9), None)])
    assert restarted.router.active is None and stopped_engine.closed
    assert read_serving_state(tmp_path)["canary"] is None


def test_a_canary_that_cannot_be_served_is_logged_and_leaves_everyone_on_production(
    store, tmp_path, monkeypatch, caplog
):
    """vLLM engine, no FLYWHEEL_SERVING_CANARY_URL: the watcher starts a managed canary server; one
    that cannot start (here: the checkpoint folder holds no model, or vLLM is not installed) is an
    error in the log, never a dead watcher re-reading the same message."""
    from app.core.settings import get_settings

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "vllm")
    monkeypatch.delenv("FLYWHEEL_SERVING_CANARY_URL", raising=False)
    get_settings.cache_clear()
    prod = RecordingEngine("base")
    canary = CanaryFollower(EngineRouter(prod), store=store)  # the real factory: setup_engine, role canary
    follower = ProductionFollower(prod, store=store, home=tmp_path, canary=canary)
    try:
        with caplog.at_level("ERROR", logger="flywheel.canary"):
            follower.handle_batch([(_msg("canary.started", "c-1", "ckpt-1", 3), None)])
        assert canary.router.active is None and canary.router.canary_engine is None
        logged = [r.getMessage() for r in caplog.records if "cannot be served" in r.getMessage()]
        assert logged and ("config.json" in logged[0] or "not installed" in logged[0])
        assert not canary.accept(_msg("canary.started", "c-1", "ckpt-1", 3))  # handled: not re-read forever
        assert read_serving_state(tmp_path)["canary"] is None
        follower.handle_batch([(_msg("canary.stopped", "c-1", "ckpt-1", 4), None)])
        assert canary.router.active is None and not (tmp_path / "vllm" / "canary.json").exists()
    finally:
        get_settings.cache_clear()

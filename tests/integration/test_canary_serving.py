"""A canary served for real: two reference engines (two weight sets) behind the router, the simulator
as live traffic, and the serving watcher following canary start/stop through the broker."""

from __future__ import annotations

from collections import defaultdict

import pytest

from app.lifecycle.assignment import assign_arm
from app.outbox.relay import OutboxRelay
from ops.simulator import SimulatorConfig, run_simulation
from serving.canary import ActiveCanary, CanaryFollower, EngineRouter
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import auth, base, client, gated, lifecycle_topic, make_token, store  # noqa: F401
from tests.unit.test_api_units import RecordingEngine
from tests.unit.test_canary_serving import ClosableEngine

pytestmark = pytest.mark.integration


def test_simulated_users_are_served_by_their_arm(tiny_model_dir, tmp_path):
    from app.checkpoints.testing import build_tiny_model
    from serving.reference_engine import ReferenceEngine

    prod = ReferenceEngine(tiny_model_dir, checkpoint_id="prod", num_threads=1)
    cand = ReferenceEngine(build_tiny_model(tmp_path / "cand", seed=7), checkpoint_id="cand", num_threads=1)
    router = EngineRouter(prod)
    router.start(ActiveCanary(canary_id="c-sim", checkpoint_id="cand", fraction=0.5), cand)
    events = []
    summaries = run_simulation(
        SimulatorConfig(
            sessions=6,
            group_size=3,
            max_turns=1,
            max_tokens=16,
            max_tokens_per_turn=8,
            persistence_delay_s=0,
            users=6,
            seed=2,
        ),
        prod,
        events.append,
        engine_for=router.engine_for,
    )
    assert len(summaries) == 6 and all("error" not in s for s in summaries)
    served = defaultdict(set)
    for e in events:
        if e.type in ("session.started", "model.responded"):
            served[e.user_id].add(e.payload.checkpoint_id)
    assert served and all(len(ids) == 1 for ids in served.values())  # one user, one checkpoint
    for user, ids in served.items():
        assert ids == {"cand" if assign_arm(user, "c-sim", 0.5) == "canary" else "prod"}
    assert {s["checkpoint_id"] for s in summaries} == {"prod", "cand"}  # both arms had traffic


def test_watcher_follows_canary_start_and_stop_through_the_broker(
    client, session, store, gated, lifecycle_topic, kafka_bootstrap, tmp_path, monkeypatch
):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    rm = auth(make_token(session, "release_manager", name="alice"))
    started = client.post(
        "/v1/canaries", headers=rm, json={"checkpoint_id": gated.id, "fraction": 0.3, "reason": "try it on 30 %"}
    )
    assert started.status_code == 201, started.text
    with OutboxRelay() as relay:
        assert relay.relay_pending() == 1
    built = []
    prod = RecordingEngine("base")
    router = EngineRouter(prod)
    watcher = ServingWatcher(
        prod,
        store=store,
        canary=CanaryFollower(router, store=store, factory=lambda cid, path: built.append(cid) or ClosableEngine(cid)),
    )
    try:
        for _ in range(40):
            watcher.poll_once(timeout_ms=250)
            if router.active is not None:
                break
        assert built == [gated.id] and router.active.canary_id == started.json()["id"]
        assert router.active.fraction == 0.3 and prod.calls == []
        assert client.request("DELETE", "/v1/canaries", headers=rm, json={"reason": "done"}).status_code == 200
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1
        for _ in range(40):
            watcher.poll_once(timeout_ms=250)
            if router.active is None:
                break
        assert router.active is None and {router.engine_for(f"u{i}") for i in range(50)} == {prod}
    finally:
        watcher.stop()

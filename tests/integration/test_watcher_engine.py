"""The watcher moves a REAL in-process engine (``ReferenceEngine`` on tiny random Llamas): a promotion
is a full load that yields the child's (bf16 serving) weights, a rollback one that restores the
parent's exactly; the engine then generates."""

from __future__ import annotations

import json
import shutil

import pytest

from app.outbox.relay import OutboxRelay
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import auth, client, lifecycle_topic, make_token, store  # noqa: F401
from tests.integration.test_watcher import _poll_until_moved

pytestmark = pytest.mark.integration


class Recording:
    """Wraps a real engine and records how it was moved."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    @property
    def checkpoint_id(self) -> str:
        return self.engine.checkpoint_id

    def load_checkpoint(self, checkpoint_id, path):
        self.calls.append(("full", checkpoint_id))
        self.engine.load_checkpoint(checkpoint_id, path)


def _state(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_watcher_moves_a_reference_engine_by_full_loads(
    client, session, store, lifecycle_topic, kafka_bootstrap, tiny_model_dir, tmp_path, monkeypatch
):
    import torch

    from app.checkpoints.testing import build_tiny_model
    from app.models import Checkpoint
    from serving.reference_engine import ReferenceEngine
    from tests.integration.test_api_support import seed_gate

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    child_src = build_tiny_model(tmp_path / "child-src", seed=1)
    for cid, src, parent in (("base", tiny_model_dir, None), ("ckpt-0001", child_src, "base")):
        with store.writer(cid) as d:
            shutil.copytree(src, d, dirs_exist_ok=True)
            (d / "manifest.json").write_text(json.dumps({"parent_id": parent}))
        session.add(
            Checkpoint(
                id=cid,
                parent_id=parent,
                status="production" if parent is None else "candidate",
                path=str(store.stable_path(cid)),
                stable=True,
                generation=int(parent is not None),
                manifest={},
                metrics={},
            )
        )
        session.commit()
    seed_gate(session, "ckpt-0001", "base", passed=True)
    rm = auth(make_token(session, "release_manager", name="alice"))
    assert (
        client.post(
            "/v1/promotions",
            headers=rm,
            json={"checkpoint_id": "ckpt-0001", "reason": "r", "expected_production_id": "base"},
        ).status_code
        == 201
    )
    with OutboxRelay() as relay:
        relay.relay_pending()

    engine = Recording(ReferenceEngine(store.stable_path("base"), checkpoint_id="base", num_threads=1))
    watcher = ServingWatcher(engine, store=store)
    try:
        _poll_until_moved(watcher, engine, 1)
        assert engine.calls == [("full", "ckpt-0001")] and engine.checkpoint_id == "ckpt-0001"
        served = engine.engine.model.state_dict()
        child = _state(child_src)
        for name, tensor in child.items():  # serving weights are bf16 (the engine's choice)
            assert torch.equal(served[name].to(torch.bfloat16), tensor.to(torch.bfloat16)), name

        assert (
            client.post(
                "/v1/rollbacks", headers=rm, json={"reason": "r", "expected_production_id": "ckpt-0001"}
            ).status_code
            == 201
        )
        with OutboxRelay() as relay:
            relay.relay_pending()
        _poll_until_moved(watcher, engine, 2)
        assert engine.calls[-1] == ("full", "base")
        served = engine.engine.model.state_dict()
        for name, tensor in _state(tiny_model_dir).items():  # serving weights are bf16 (engine's choice)
            assert torch.equal(served[name].to(torch.bfloat16), tensor.to(torch.bfloat16)), name
        from app.inference.engine import SamplingParams

        (gen,) = engine.engine.generate([[1, 2, 3]], SamplingParams(max_tokens=3, temperature=0.0))
        assert len(gen.token_ids) >= 1
    finally:
        watcher.stop()
    assert client.get("/v1/production", headers=rm).json()["serving_checkpoint_id"] == "base"

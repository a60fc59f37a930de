"""The watcher moves a REAL in-process engine (``TorchEngine`` on tiny random Llamas): a promotion
is applied as the trainer's bf16 ``delta.zst`` and yields the child's serving weights; a rollback
is a full load that restores the parent's (bf16 serving) weights exactly; the engine then generates."""

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

    def apply_delta(self, checkpoint_id, delta_path, parent_id):
        self.calls.append(("delta", checkpoint_id))
        self.engine.apply_delta(checkpoint_id, delta_path, parent_id)


def _state(model_dir):
    from safetensors.torch import load_file

    return load_file(str(model_dir / "model.safetensors"))


def test_watcher_moves_a_torch_engine_by_delta_then_full_load(
    client, session, store, lifecycle_topic, kafka_bootstrap, tiny_model_dir, tmp_path, monkeypatch
):
    import torch

    from app.checkpoints.delta import write_delta
    from app.checkpoints.testing import build_tiny_model
    from app.models import Checkpoint
    from serving.torch_engine import TorchEngine
    from tests.integration.test_api_support import seed_gate

    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    child_src = build_tiny_model(tmp_path / "child-src", seed=1)
    for cid, src, parent in (("base", tiny_model_dir, None), ("ckpt-0001", child_src, "base")):
        with store.writer(cid) as d:
            shutil.copytree(src, d, dirs_exist_ok=True)
            (d / "manifest.json").write_text(json.dumps({"parent_id": parent}))
            if parent:
                write_delta(
                    _state(tiny_model_dir), _state(child_src), d / "delta.zst", parent_id=parent, checkpoint_id=cid
                )
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

    engine = Recording(TorchEngine(store.stable_path("base"), checkpoint_id="base", num_threads=1))
    watcher = ServingWatcher(engine, store=store)
    try:
        _poll_until_moved(watcher, engine, 1)
        assert engine.calls == [("delta", "ckpt-0001")] and engine.checkpoint_id == "ckpt-0001"
        served = engine.engine.model.state_dict()
        child = _state(child_src)
        for name, tensor in child.items():  # the delta carries the child's bf16 serving weights
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

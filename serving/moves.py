"""How serving gets from the checkpoint it serves to a target: no move, or a full load of the
target's STABLE directory, planned from a lifecycle message.

Invariant: a move is planned only to a STABLE directory (the message's path when it is one, else the
store's); weights move by a full reload of that folder (vLLM's ``reload_weights`` through flywheel's
worker extension: about 2 s for SmolLM2-135M on 2 CPUs, docs/serving.md), never by a delta.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Protocol

from app.checkpoints.store import STABLE, CheckpointStore
from app.lifecycle.messages import ProductionChanged


class Engine(Protocol):
    """The part of ``app.inference.engine.InferenceEngine`` the watcher drives."""

    checkpoint_id: str

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None: ...


@dataclass(frozen=True)
class Move:
    """How the engine gets from the serving checkpoint to the target."""

    target_id: str
    method: Literal["noop", "full"]
    path: Path | None = None  # full-load directory


def resolve_dir(entry_path: str | None, checkpoint_id: str, store: CheckpointStore) -> Path:
    """``entry_path`` when it is a STABLE directory here, else the store's STABLE directory.

    Raises:
        CheckpointError: the checkpoint has no STABLE directory in the store.
    """
    if entry_path and (Path(entry_path) / STABLE).exists():
        return Path(entry_path)
    return store.stable_path(checkpoint_id)


def plan_move(serving_id: str | None, message: ProductionChanged, store: CheckpointStore) -> Move:
    """No move when ``serving_id`` is the message's checkpoint, else a full load of its directory.

    Raises:
        CheckpointError: the target directory is missing or not STABLE.
    """
    target = message.checkpoint_id
    if serving_id == target:
        return Move(target_id=target, method="noop")
    return Move(target_id=target, method="full", path=resolve_dir(message.path, target, store))

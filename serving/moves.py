"""How serving gets from the checkpoint it serves to a target: the cheapest move (none, a chain of
weight deltas, or a full load) planned from a lifecycle message's lineage.

Invariant: a delta chain is planned only when the target descends from what is served, every
delta on the way is on disk, and the engine applies deltas itself; anything else is a full load
of the target's STABLE directory.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from app.checkpoints.delta import DELTA_FILE
from app.checkpoints.store import STABLE, CheckpointStore
from app.core.errors import CheckpointError


class Engine(Protocol):
    """The part of ``app.inference.engine.InferenceEngine`` the watcher drives."""

    checkpoint_id: str

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None: ...

    def apply_delta(self, checkpoint_id: str, delta_path: Path, parent_id: str) -> None: ...

    # optional: ``applies_deltas`` (default True), False when apply_delta reloads the full folder


@dataclass(frozen=True)
class Move:
    """How the engine gets from the serving checkpoint to the target."""

    target_id: str
    method: str  # "noop" | "delta" | "full"
    steps: tuple[tuple[str, Path, str], ...] = ()  # (checkpoint_id, delta path, parent id), parent first
    path: Path | None = None  # full-load directory


def resolve_dir(entry_path: str | None, checkpoint_id: str, store: CheckpointStore) -> Path:
    if entry_path and (Path(entry_path) / STABLE).exists():
        return Path(entry_path)
    return store.stable_path(checkpoint_id)


def plan_move(serving_id: str | None, payload: dict[str, Any], store: CheckpointStore, *, deltas: bool = True) -> Move:
    """The cheapest way from ``serving_id`` to the message's checkpoint.

    ``payload["lineage"]`` lists ``{"id", "path"}`` from the target back to the base (written by
    ``app.promotion.service``). Delta steps are returned parent first. ``deltas=False`` (an engine
    that cannot apply them, e.g. vLLM) plans a full load of the target instead.

    Raises:
        CheckpointError: the target directory is missing or not STABLE.
    """
    target = payload["checkpoint_id"]
    if serving_id == target:
        return Move(target_id=target, method="noop")
    chain = payload.get("lineage") or [{"id": target, "path": payload.get("path")}]
    ids = [c["id"] for c in chain]
    full = Move(target_id=target, method="full", path=resolve_dir(payload.get("path"), target, store))
    if not deltas or serving_id is None or serving_id not in ids[1:]:
        return full
    steps = []
    descendants = chain[: ids.index(serving_id)]  # target ... child of serving
    parent = serving_id
    for entry in reversed(descendants):
        try:
            delta = resolve_dir(entry.get("path"), entry["id"], store) / DELTA_FILE
        except CheckpointError:
            return full
        if not delta.exists():
            return full
        steps.append((entry["id"], delta, parent))
        parent = entry["id"]
    return Move(target_id=target, method="delta", steps=tuple(steps))

"""The checkpoint store on a filesystem: atomic, marked directories.

Layout: ``<root>/<checkpoint_id>/`` holding the Hugging Face model folder (``config.json``,
``model.safetensors``, tokenizer files), ``manifest.json`` and a ``STABLE`` marker written last.
Writers build the directory under ``<root>/.staging/<id>-<random>/``, fsync, ``rename`` it into
place (atomic on one filesystem), then touch ``STABLE``. Readers act only on directories with the
marker, so a writer killed at any point leaves nothing visible; ``sweep_staging`` removes leftovers.
(After prime-rl's filesystem weight transport.)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from app.core.errors import CheckpointError
from app.core.settings import get_settings
from app.models.checkpoints import STABLE_MARKER
from producers.files import fsync_dir

STABLE = STABLE_MARKER
MANIFEST = "manifest.json"
STAGING = ".staging"


def sha256_file(path: Path, chunk_bytes: int = 1 << 20) -> str:
    """Hex sha256 of a file, read in ``chunk_bytes`` chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk_bytes):
            h.update(block)
    return h.hexdigest()


def check_hf_folder(path: Path) -> dict[str, Any]:
    """Validate a Hugging Face causal-LM folder and return its ``config.json``: a config, weights
    whose safetensors headers parse, and a tokenizer (what a vLLM reload or a load needs).

    Raises:
        CheckpointError: not a folder, no config.json, no weights, an unreadable safetensors header,
            or no tokenizer.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path} is not a folder")
    if not (path / "config.json").exists():
        raise CheckpointError(f"{path} has no config.json: not a Hugging Face model folder")
    weights = sorted(path.glob("*.safetensors"))
    if not weights and not any(path.glob("*.bin")):
        raise CheckpointError(f"{path} has no weights (*.safetensors / *.bin)")
    for w in weights:
        try:
            with open(w, "rb") as f:
                (size,) = struct.unpack("<Q", f.read(8))
                if size > w.stat().st_size - 8:
                    raise ValueError(f"a header of {size} bytes in a file of {w.stat().st_size}")
                json.loads(f.read(size))
        except (OSError, struct.error, ValueError) as exc:
            raise CheckpointError(f"{w} is not a readable safetensors file: {exc}") from exc
    if not (path / "tokenizer.json").exists() and not (path / "tokenizer_config.json").exists():
        raise CheckpointError(f"{path} has no tokenizer files")
    config: dict[str, Any] = json.loads((path / "config.json").read_text())
    return config


class CheckpointStore:
    """Checkpoint directories under ``root`` (see module docstring)."""

    def __init__(self, root: Path) -> None:
        self.root = Path(root)

    @classmethod
    def from_settings(cls) -> "CheckpointStore":
        """The store at ``FLYWHEEL_CHECKPOINT_DIR`` (default ``$FLYWHEEL_HOME/checkpoints``)."""
        return cls(get_settings().store.checkpoints())

    def path(self, checkpoint_id: str) -> Path:
        """Directory of a checkpoint (it may not exist or be unmarked)."""
        if not checkpoint_id or "/" in checkpoint_id or checkpoint_id.startswith("."):
            raise CheckpointError(f"invalid checkpoint id {checkpoint_id!r}")
        return self.root / checkpoint_id

    def is_stable(self, checkpoint_id: str) -> bool:
        """Whether the checkpoint's directory is complete (has the ``STABLE`` marker)."""
        return (self.path(checkpoint_id) / STABLE).exists()

    def stable_path(self, checkpoint_id: str) -> Path:
        """The directory of a STABLE checkpoint.

        Raises:
            CheckpointError: missing or not marked STABLE.
        """
        path = self.path(checkpoint_id)
        if not (path / STABLE).exists():
            raise CheckpointError(f"checkpoint {checkpoint_id} is not STABLE at {path}")
        return path

    def list_stable(self) -> list[str]:
        """Ids of every STABLE checkpoint, sorted."""
        if not self.root.exists():
            return []
        return sorted(
            p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith(".") and (p / STABLE).exists()
        )

    def manifest(self, checkpoint_id: str) -> dict[str, Any]:
        """The manifest of a STABLE checkpoint."""
        manifest: dict[str, Any] = json.loads((self.stable_path(checkpoint_id) / MANIFEST).read_text())
        return manifest

    @contextmanager
    def writer(self, checkpoint_id: str) -> Iterator[Path]:
        """Yield a staging directory; on clean exit publish it as ``checkpoint_id`` atomically.

        The caller writes every file (model, tokenizer, ``manifest.json`` without ``files``) into the
        yielded directory. On exit the store adds sha256 of every file to the manifest, fsyncs,
        renames, and writes ``STABLE``. On an exception the staging directory is removed.

        Raises:
            CheckpointError: ``checkpoint_id`` already exists as a STABLE checkpoint.
        """
        final = self.path(checkpoint_id)
        if (final / STABLE).exists():
            raise CheckpointError(f"checkpoint {checkpoint_id} already exists")
        staging = self.root / STAGING / f"{checkpoint_id}-{uuid.uuid4().hex[:8]}"
        staging.mkdir(parents=True)
        try:
            yield staging
            self._seal(staging)
            if final.exists():  # an unmarked leftover of a killed writer: never visible, replace it
                shutil.rmtree(final)
            os.replace(staging, final)
            fsync_dir(self.root)
            (final / STABLE).write_text(checkpoint_id + "\n")
            fsync_dir(final)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise

    def _seal(self, staging: Path) -> None:
        manifest_path = staging / MANIFEST
        manifest = json.loads(manifest_path.read_text()) if manifest_path.exists() else {}
        files = {}
        for p in sorted(staging.rglob("*")):
            if p.is_file() and p.name not in (MANIFEST, STABLE):
                files[str(p.relative_to(staging))] = {"sha256": sha256_file(p), "bytes": p.stat().st_size}
                with open(p, "rb") as f:
                    os.fsync(f.fileno())
        manifest["files"] = files
        manifest_path.write_text(json.dumps(manifest, indent=2, sort_keys=True, default=str))

    def verify(self, checkpoint_id: str) -> list[str]:
        """Files whose sha256 or size differ from the manifest (empty list: intact)."""
        path = self.stable_path(checkpoint_id)
        bad = []
        for name, meta in self.manifest(checkpoint_id).get("files", {}).items():
            f = path / name
            if not f.exists() or f.stat().st_size != meta["bytes"] or sha256_file(f) != meta["sha256"]:
                bad.append(name)
        return bad

    def sweep_staging(self) -> int:
        """Remove staging leftovers of killed writers and unmarked directories. Returns count removed."""
        removed = 0
        staging = self.root / STAGING
        if staging.exists():
            for p in staging.iterdir():
                shutil.rmtree(p, ignore_errors=True)
                removed += 1
        if self.root.exists():
            for p in self.root.iterdir():
                if p.is_dir() and not p.name.startswith(".") and not (p / STABLE).exists():
                    shutil.rmtree(p, ignore_errors=True)
                    removed += 1
        return removed

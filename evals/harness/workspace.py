"""The task repository on disk: materialize, snapshot, and resolve paths without escaping it.

Invariant: every path the agent names is resolved inside the workspace root (symlinks followed);
anything else raises ``PathEscapeError`` before a file is touched.
"""

from __future__ import annotations

import os
from pathlib import Path

from evals.harness.environment import ENV_DIR

SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".mypy_cache", ENV_DIR}  # ENV_DIR: links into the host


class PathEscapeError(ValueError):
    """A tool named a path outside the workspace."""


def resolve_inside(root: Path, path: str) -> Path:
    """``root / path`` resolved, refusing absolute paths, ``..`` escapes and escaping symlinks.

    Raises:
        PathEscapeError: the resolved path is not inside ``root``.
    """
    root = Path(root).resolve()
    if not path or "\x00" in path:
        raise PathEscapeError("empty or invalid path")
    candidate = Path(path)
    if candidate.is_absolute():
        try:
            candidate = candidate.resolve().relative_to(root)
        except ValueError:
            raise PathEscapeError(f"{path} is outside the repository") from None
    resolved = (root / candidate).resolve()
    if resolved != root and root not in resolved.parents:
        raise PathEscapeError(f"{path} is outside the repository")
    return resolved


def write_files(root: Path, files: dict[str, str]) -> None:
    """Write ``files`` (relative path -> text) under ``root``, creating directories."""
    for rel, text in files.items():
        target = resolve_inside(root, rel)
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_text(text, encoding="utf-8")


def snapshot(root: Path, max_bytes: int = 1_000_000) -> dict[str, str]:
    """Text files under ``root`` (relative POSIX path -> content), skipping caches and binaries."""
    root = Path(root).resolve()
    out: dict[str, str] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in SKIP_DIRS)
        for name in sorted(filenames):
            p = Path(dirpath) / name
            if p.is_symlink() or p.stat().st_size > max_bytes:
                continue
            try:
                out[p.relative_to(root).as_posix()] = p.read_text(encoding="utf-8")
            except (UnicodeDecodeError, OSError):
                continue
    return out

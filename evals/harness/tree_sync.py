"""Copy a task tree to the sandbox uid and bring its changes back (``evals.harness.sandbox`` as root).

Invariants:
- :func:`tree_entries` lists files, directories and symlinks without following symlinks, and
  refuses a tree of more than ``limit`` entries (``ValueError``), so a runaway tree is never walked whole.
- :func:`sync_tree` copies symlinks as links (never what they point to), writes at most
  ``max_files`` entries, deletes only entries the sandbox saw (``before``) and removed, and leaves
  entries of the destination the sandbox never saw alone.
- :func:`chown_tree` hands a whole tree to one uid/gid without following symlinks below its root.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

MAX_TREE_ENTRIES = 20_000


def tree_entries(root: Path, limit: int = MAX_TREE_ENTRIES) -> set[str]:
    """Relative paths of every file, directory and symlink under ``root`` (symlinks not followed).

    Raises:
        ValueError: more than ``limit`` entries (not a task repository).
    """
    out: set[str] = set()
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        for name in dirnames + filenames:
            out.add(str(rel_dir / name))
        if len(out) > limit:
            raise ValueError(f"{root} has more than {limit} entries: not a task repository")
    return out


def sync_tree(src: Path, dst: Path, before: set[str], max_files: int = MAX_TREE_ENTRIES) -> None:
    """Apply the sandbox's changes to ``dst``: what ``src`` holds is copied over (symlinks as links,
    at most ``max_files`` entries), and what was in ``before`` (the tree copied in) but is gone from
    ``src`` is deleted. Entries of ``dst`` the sandbox never saw are left alone."""
    after = sorted(tree_entries(src, limit=10 * max_files))[:max_files]
    for rel in after:
        s_path, d_path = src / rel, dst / rel
        if s_path.is_dir() and not s_path.is_symlink():
            if d_path.is_symlink() or (d_path.exists() and not d_path.is_dir()):
                d_path.unlink()
            d_path.mkdir(parents=True, exist_ok=True)
            continue
        if d_path.is_dir() and not d_path.is_symlink():
            shutil.rmtree(d_path)
        elif d_path.is_symlink() or d_path.exists():
            if not s_path.is_symlink() and not d_path.is_symlink() and _same_file(s_path, d_path):
                continue
            d_path.unlink()
        d_path.parent.mkdir(parents=True, exist_ok=True)
        if s_path.is_symlink():
            os.symlink(os.readlink(s_path), d_path)
        else:
            shutil.copyfile(s_path, d_path)
    for rel in sorted(before - set(after), key=lambda r: -r.count(os.sep)):  # deepest first
        target = dst / rel
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target, ignore_errors=True)
        else:
            target.unlink(missing_ok=True)


def _same_file(a: Path, b: Path) -> bool:
    if a.stat().st_size != b.stat().st_size:
        return False
    return a.read_bytes() == b.read_bytes()


def chown_tree(root: Path, uid: int, gid: int | None = None) -> None:
    """Give ``root`` and everything under it to ``uid`` (group ``gid``, default ``uid``); symlinks
    below ``root`` are changed themselves, not followed; entries that vanish meanwhile are skipped.

    Raises:
        OSError: ``root`` cannot be changed (e.g. not root).
    """
    gid = uid if gid is None else gid
    os.chown(root, uid, gid)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                os.chown(os.path.join(dirpath, name), uid, gid, follow_symlinks=False)
            except FileNotFoundError:
                continue

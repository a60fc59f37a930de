"""The stack's private files (``stack.json``, ``stack.env``: they hold credentials) are written
atomically and owner-only, and a write that fails leaves the old file and nothing beside it."""

from __future__ import annotations

import os
import stat

import pytest

from ops import stack


def test_a_private_file_is_owner_only_and_replaced_whole(tmp_path):
    path = tmp_path / "stack.env"
    stack._write_private(path, "A=1\n")
    stack._write_private(path, "A=2\n")
    assert path.read_text() == "A=2\n"
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.env"]


def test_a_failed_write_keeps_the_old_file_and_leaves_no_temporary_one(tmp_path, monkeypatch):
    path = tmp_path / "stack.json"
    stack._write_private(path, '{"old": true}')

    def full_disk(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", full_disk)
    with pytest.raises(OSError, match="No space left"):
        stack._write_private(path, '{"new": true}')
    assert path.read_text() == '{"old": true}'
    assert sorted(p.name for p in tmp_path.iterdir()) == ["stack.json"]

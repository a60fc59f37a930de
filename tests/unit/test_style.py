"""ruff's lint rules and formatter (``[tool.ruff]`` in pyproject.toml) hold on the whole tree."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _ruff(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "ruff", *args], cwd=REPO, capture_output=True, text=True, timeout=300)


def test_ruff_lint_passes():
    proc = _ruff("check", "--no-cache", ".")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]


def test_ruff_format_is_applied():
    proc = _ruff("format", "--check", "--no-cache", ".")
    assert proc.returncode == 0, "run `ruff format .`:\n" + proc.stdout[-4000:] + proc.stderr[-2000:]

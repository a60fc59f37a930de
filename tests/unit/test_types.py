"""The strictly typed modules type-check (``[tool.mypy]`` in pyproject.toml: ``mypy --strict`` on
``app/lifecycle``, ``trainer/loss.py`` and ``evals/gate.py``), and the check fails on a planted type
error, so CI runs a type checker that can say no."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def _mypy(root: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "mypy", *paths], cwd=root, capture_output=True, text=True, timeout=900)


def test_the_strict_modules_type_check():
    proc = _mypy(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


def test_a_planted_type_error_fails_the_check(tmp_path):
    """A status written as a bare string where the enum is expected is caught."""
    shutil.copytree(REPO / "app", tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "producers", tmp_path / "producers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    status = tmp_path / "app" / "lifecycle" / "status.py"
    status.write_text(
        status.read_text() + '\n\ndef _planted(row: Checkpoint) -> str:\n    return move(row, "retired")\n'
    )
    proc = _mypy(tmp_path, "app/lifecycle/status.py")
    assert proc.returncode != 0
    assert 'Argument 2 to "move" has incompatible type "str"' in proc.stdout, proc.stdout[-4000:]

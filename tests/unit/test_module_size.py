"""Files at one job each: no Python module of the repository over 500 lines, and none over 400
without a ``Size:`` paragraph in its module docstring saying why it holds together."""

from __future__ import annotations

import ast
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
HARD_LIMIT, SOFT_LIMIT = 500, 400


def _modules() -> list[Path]:
    tracked = subprocess.run(["git", "ls-files", "*.py"], cwd=REPO, capture_output=True, text=True, check=True)
    return [REPO / p for p in tracked.stdout.split() if not p.startswith("migrations/versions/")]


def test_no_module_is_over_the_limits():
    over, unexplained = [], []
    for path in _modules():
        text = path.read_text()
        lines = text.count("\n")
        if lines > HARD_LIMIT:
            over.append(f"{path.relative_to(REPO)} ({lines})")
        elif lines > SOFT_LIMIT and "Size:" not in (ast.get_docstring(ast.parse(text)) or ""):
            unexplained.append(f"{path.relative_to(REPO)} ({lines})")
    assert not over, f"modules over {HARD_LIMIT} lines: split them: {over}"
    assert not unexplained, (
        f"modules over {SOFT_LIMIT} lines without a 'Size:' reason in their docstring: {unexplained}"
    )

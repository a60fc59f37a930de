"""The product type-checks as ``[tool.mypy]`` in pyproject.toml sets it (every product package;
strict on ``app``, ``producers``, ``consumers``, the gate and the policy loss), the checker covers at
least half of the product's lines (``tests.type_coverage``), every ``# type: ignore`` names its
error code, and the check fails on a planted type error, so CI runs a type checker that can say no.

Both mypy runs share one cache directory under a temporary path (one xdist group, so one worker
runs them in order): the planted run then reads the third-party types the first run cached."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.type_coverage import measure_type_coverage

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.xdist_group("mypy")


@pytest.fixture(scope="module")
def mypy_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("mypy-cache")


def _mypy(root: Path, cache: Path, *paths: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "mypy", "--cache-dir", str(cache), *paths],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=2100,
    )


@pytest.mark.timeout(
    2400
)  # a cold run costs ~2 min of CPU; on a loaded 2-core host its wall time is several times that
def test_the_product_type_checks(mypy_cache):
    proc = _mypy(REPO, mypy_cache)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "Success: no issues found" in proc.stdout


def test_the_checker_covers_the_product_and_is_strict_where_the_rules_live():
    cov = measure_type_coverage(REPO)
    assert cov.checked_share >= 0.5, cov
    for package in ("app", "producers", "consumers"):
        lines = sum(len(p.read_bytes().splitlines()) for p in (REPO / package).rglob("*.py"))
        assert cov.strict_packages[package] == lines, f"{package} is not strict throughout"


def test_a_planted_type_error_fails_the_check(tmp_path, mypy_cache):
    """A status written as a bare string where the enum is expected is caught."""
    shutil.copytree(REPO / "app", tmp_path / "app", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "producers", tmp_path / "producers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    status = tmp_path / "app" / "lifecycle" / "status.py"
    status.write_text(
        status.read_text() + '\n\ndef _planted(row: Checkpoint) -> str:\n    return move(row, "retired")\n'
    )
    proc = _mypy(tmp_path, mypy_cache, "app/lifecycle/status.py")
    assert proc.returncode != 0
    assert 'Argument 2 to "move" has incompatible type "str"' in proc.stdout, proc.stdout[-4000:]


def test_an_ignore_without_its_error_code_fails_the_check(tmp_path, mypy_cache):
    """``enable_error_code = ignore-without-code``: a bare ``# type: ignore`` is an error."""
    shutil.copytree(REPO / "producers", tmp_path / "producers", ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copy2(REPO / "pyproject.toml", tmp_path / "pyproject.toml")
    errors = tmp_path / "producers" / "errors.py"
    errors.write_text(errors.read_text() + '\n\n_PLANTED: int = "not an int"  # type: ignore\n')
    proc = _mypy(tmp_path, mypy_cache, "producers/errors.py")
    assert proc.returncode != 0
    assert "[ignore-without-code]" in proc.stdout, proc.stdout[-4000:]

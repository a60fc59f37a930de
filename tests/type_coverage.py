"""The share of the product's lines the type checker covers, as ``[tool.mypy]`` in pyproject.toml
sets it: read through mypy's own option parser, so the files and per-module modes counted are the
ones ``mypy`` checks.

Invariant: a line counts as covered when its module is among the files mypy checks and its errors
are not ignored (``ignore_errors``); as strict when that module's options are strict's (``disallow_untyped_defs`` and ``check_untyped_defs``: every
function annotated and every body checked). The product is the packages pyproject.toml installs
(``[tool.setuptools.packages.find]``); tests and bench are not product. Lines are physical lines
(``wc -l``), docstrings and comments included.

Run ``python -m tests.type_coverage`` from the repository root for the figures (one JSON line).
"""

from __future__ import annotations

import io
import json
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from mypy.main import process_options

REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class TypeCoverage:
    """Product lines and how many of them mypy checks (``checked``) and checks strictly (``strict``)."""

    product_lines: int
    checked_lines: int
    strict_lines: int
    checked_share: float
    strict_share: float
    strict_packages: dict[str, int]
    """Lines checked strictly, per top-level package."""


def product_packages(root: Path = REPO) -> list[str]:
    """The top-level packages pyproject.toml installs (``app*`` ... -> ``app``)."""
    with open(root / "pyproject.toml", "rb") as f:
        include = tomllib.load(f)["tool"]["setuptools"]["packages"]["find"]["include"]
    return [pattern.rstrip("*") for pattern in include]


def measure_type_coverage(root: Path = REPO) -> TypeCoverage:
    """Count the product's lines and the ones mypy covers under ``root``'s pyproject.toml.

    Raises:
        SystemExit: mypy refuses the configuration (its own message on stderr).
    """
    sources, options = process_options(
        ["--config-file", str(root / "pyproject.toml")], stdout=io.StringIO(), stderr=io.StringIO()
    )
    checked = {Path(s.path).resolve(): s.module for s in sources if s.path}
    product = [p for pkg in product_packages(root) for p in sorted((root / pkg).rglob("*.py"))]
    total = checked_lines = strict_lines = 0
    per_package: dict[str, int] = {}
    for path in product:
        lines = len(path.read_bytes().splitlines())
        total += lines
        module = checked.get(path.resolve())
        if module is None:
            continue
        mode = options.clone_for_module(module)
        if mode.ignore_errors:
            continue
        checked_lines += lines
        if mode.disallow_untyped_defs and mode.check_untyped_defs:
            strict_lines += lines
            package = path.relative_to(root).parts[0]
            per_package[package] = per_package.get(package, 0) + lines
    return TypeCoverage(
        product_lines=total,
        checked_lines=checked_lines,
        strict_lines=strict_lines,
        checked_share=checked_lines / total if total else 0.0,
        strict_share=strict_lines / total if total else 0.0,
        strict_packages=per_package,
    )


if __name__ == "__main__":
    print(json.dumps(asdict(measure_type_coverage())))

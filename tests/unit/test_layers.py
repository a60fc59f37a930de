"""The import-layer contracts (``[tool.importlinter]`` in pyproject.toml) hold on this tree, and the
check fails when a core module imports a higher package, a promotion room reaches back up, or the
app imports the migrations."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("app", "producers", "consumers", "trainer", "kernels", "evals", "serving", "ops", "migrations")


def _lint_imports(root: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(root)}
    script = "import sys; from importlinter.cli import lint_imports_command; sys.exit(lint_imports_command())"
    return subprocess.run(
        [sys.executable, "-c", script], cwd=root, env=env, capture_output=True, text=True, timeout=300
    )


def _copy_tree(dst: Path) -> None:
    for pkg in PACKAGES:
        shutil.copytree(REPO / pkg, dst / pkg, ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))
    shutil.copy2(REPO / "pyproject.toml", dst / "pyproject.toml")


def test_the_contracts_hold():
    proc = _lint_imports(REPO)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


def test_a_core_module_importing_a_higher_package_breaks_the_check(tmp_path):
    _copy_tree(tmp_path)
    errors = tmp_path / "app" / "core" / "errors.py"
    errors.write_text(errors.read_text() + "\nfrom consumers import cli as _planted  # noqa: E402,F401\n")
    sdk = tmp_path / "producers" / "files.py"
    sdk.write_text(sdk.read_text() + "\nimport sqlalchemy as _planted  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "app.core is not allowed to import consumers" in proc.stdout
    assert "producers.files -> sqlalchemy" in proc.stdout


def test_an_upward_import_between_trainer_rooms_breaks_the_check(tmp_path):
    """The step (a lower room) reaching up to the cycle, even from inside a function, breaks the
    trainer's layers contract."""
    _copy_tree(tmp_path)
    step = tmp_path / "trainer" / "step.py"
    step.write_text(
        step.read_text() + "\n\ndef _planted():\n    from trainer.cycle import run_cycle\n\n    return run_cycle\n"
    )
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "trainer.step is not allowed to import trainer.cycle" in proc.stdout, proc.stdout[-4000:]


def test_a_room_reaching_back_up_breaks_the_check(tmp_path):
    _copy_tree(tmp_path)
    tasks = tmp_path / "evals" / "tasks" / "__init__.py"
    tasks.write_text(tasks.read_text() + "\nfrom evals import mined as _planted  # noqa: E402,F401\n")
    developer = tmp_path / "ops" / "developer.py"
    developer.write_text(
        developer.read_text() + "\nfrom ops.simulator import SimulatorConfig as _planted  # noqa: E402,F401\n"
    )
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "evals.tasks is not allowed to import evals.mined" in proc.stdout
    assert "ops.developer is not allowed to import ops.simulator" in proc.stdout


def test_a_lifecycle_reach_back_or_an_app_import_of_migrations_breaks_the_check(tmp_path):
    _copy_tree(tmp_path)
    canary = tmp_path / "app" / "lifecycle" / "canary.py"
    canary.write_text(canary.read_text() + "\nfrom app.lifecycle import changes as _planted  # noqa: E402,F401\n")
    migrate = tmp_path / "app" / "core" / "migrate.py"
    migrate.write_text(migrate.read_text() + "\nimport migrations as _planted  # noqa: E402,F401\n")
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "app.lifecycle.canary is not allowed to import app.lifecycle.changes" in proc.stdout
    assert "app.core.migrate -> migrations" in proc.stdout


def test_a_process_importing_promotion_the_api_importing_torch_or_an_unlisted_room_breaks_the_check(tmp_path):
    """The contracts are as strict as the code: a process reaching into ``app.promotion``, the API
    importing a process package or torch, and a module no layer names each break the check."""
    _copy_tree(tmp_path)
    watcher = tmp_path / "serving" / "watcher.py"
    watcher.write_text(watcher.read_text() + "\nfrom app.promotion import service as _planted  # noqa: E402,F401\n")
    deps = tmp_path / "app" / "api" / "deps.py"
    deps.write_text(deps.read_text() + "\nimport torch as _planted  # noqa: E402,F401\n")
    (tmp_path / "app" / "lifecycle" / "stray.py").write_text('"""A room no contract names."""\n')
    proc = _lint_imports(tmp_path)
    assert proc.returncode != 0
    assert "serving.watcher -> app.promotion.service" in proc.stdout, proc.stdout[-4000:]
    assert "app.api.deps -> torch" in proc.stdout, proc.stdout[-4000:]
    assert "app.lifecycle.stray" in proc.stdout, proc.stdout[-4000:]

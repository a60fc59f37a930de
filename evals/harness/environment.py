"""The Python environment a task's repository runs its tests in: a virtualenv in the repository.

A task whose hidden tests need distributions (a mined task, after :mod:`evals.environment_setup`
verified an environment for it) names them (``Task.environment``); the session's repository and
its graded copy each get ``ENV_DIR``, a virtualenv without system site-packages (stdlib
:mod:`venv`) whose site-packages holds links to exactly those distributions and their requirement
closure as installed on this host. Every command run in such a repository (the agent's ``run``
tool, the grading run) runs with that environment's interpreter first on ``PATH``, so a test that
imports anything else fails with ``ImportError``, on the agent's runs as on the grade.

The links point into the host interpreter's installation, which the sandbox mounts read-only
(:mod:`evals.harness.sandbox_bwrap`), so they resolve inside it.
"""

from __future__ import annotations

import sysconfig
import venv
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ENV_DIR = ".flywheel-env"


def requirement_closure(names: list[str]) -> dict[str, metadata.Distribution]:
    """The installed distributions ``names`` need: each, and recursively what its metadata requires
    (markers evaluated for this interpreter without extras). A requirement that is not installed is
    left out; a name in ``names`` that is not installed raises.

    Raises:
        importlib.metadata.PackageNotFoundError: a name in ``names`` is not installed.
    """
    out: dict[str, metadata.Distribution] = {}
    todo = [(canonicalize_name(n), True) for n in names]
    while todo:
        name, required = todo.pop()
        if name in out:
            continue
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError:
            if required:
                raise
            continue
        out[name] = dist
        for line in dist.requires or ():
            try:
                req = Requirement(line)
            except InvalidRequirement:
                continue
            if req.marker is None or req.marker.evaluate({"extra": ""}):
                todo.append((canonicalize_name(req.name), False))
    return dict(sorted(out.items()))


def _top_level_entries(dist: metadata.Distribution) -> set[str]:
    """Names directly under site-packages that ``dist`` installed (packages, modules, its dist-info)."""
    if dist.files is None:
        return set((dist.read_text("top_level.txt") or "").split())
    return {
        f.parts[0]
        for f in dist.files
        if f.parts and f.parts[0] not in ("..", "__pycache__") and not f.parts[0].endswith(".pth")
    }


def materialize_environment(repo: Path, dependencies: list[str] | tuple[str, ...]) -> dict[str, str]:
    """Create the virtualenv ``repo/ENV_DIR`` holding links to ``dependencies`` and their
    requirement closure (replacing one already there).

    Returns:
        ``{distribution: version}`` of every linked distribution.

    Raises:
        importlib.metadata.PackageNotFoundError: a named distribution is not installed.
    """
    env_dir = Path(repo) / ENV_DIR
    venv.EnvBuilder(with_pip=False, symlinks=True, clear=True).create(env_dir)
    site = Path(sysconfig.get_path("purelib", scheme="venv", vars={"base": str(env_dir), "platbase": str(env_dir)}))
    closure = requirement_closure(list(dependencies))
    for dist in closure.values():
        for top in sorted(_top_level_entries(dist)):
            source, link = Path(str(dist.locate_file(top))), site / top
            if source.exists() and not link.exists():
                link.symlink_to(source, target_is_directory=source.is_dir())
    return {name: dist.version for name, dist in closure.items()}


def has_environment(repo: Path) -> bool:
    """Whether ``repo`` holds a materialized environment (its ``ENV_DIR/pyvenv.cfg``)."""
    return (Path(repo) / ENV_DIR / "pyvenv.cfg").is_file()


def command_in_environment(command: str) -> str:
    """``command`` run from the repository root with the environment's interpreter first on PATH."""
    return f'export VIRTUAL_ENV="$PWD/{ENV_DIR}" PATH="$PWD/{ENV_DIR}/bin:$PATH"; {command}'

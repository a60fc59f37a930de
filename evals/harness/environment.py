"""The Python environment a task's repository runs its tests in: a virtualenv in the repository.

A task whose hidden tests need distributions (a mined task, after :mod:`evals.environment_setup`
verified an environment for it) names them (``Task.environment``); the session's repository and
its graded copy each get ``ENV_DIR``, a virtualenv without system site-packages (stdlib
:mod:`venv`) whose site-packages holds links to exactly those distributions and their requirement
closure as installed on this host. Every command run in such a repository (the agent's ``run``
tool, the grading run) runs with that environment's interpreter first on ``PATH``, so a test that
imports anything else fails with ``ImportError``, on the agent's runs as on the grade.

The links point into the host interpreter's site-packages path. Inside the sandbox that path holds
the run's allow-listed environment (:func:`allowed_environment`), so they resolve there when the
run's allow-list holds the task's distributions (``SandboxLimits.with_packages``) and dangle otherwise.

The allow-listed environment of a sandboxed run (:func:`allowed_environment`): a folder holding the
files of exactly the allowed distributions and their requirement closure as installed here (hard
links where the cache is on the interpreter's filesystem, else copies; dist-info included, so
``importlib.metadata`` answers), built once per allow-list and installed versions under the cache
folder (``<key>/``, renamed into place complete, under a file lock so concurrent builders wait),
and mounted read-only over the interpreter's site-packages. Nothing else installed is in view: no
eval data set, no flywheel package.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import shutil
import sys
import sysconfig
import venv
from dataclasses import dataclass
from functools import lru_cache
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name

ENV_DIR = ".flywheel-env"
ALLOWED_FORMAT = 1
"""Part of every allow-listed environment's key: bump when what a build holds changes."""
log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class AllowedEnvironment:
    """A built allow-listed environment.

    Attributes:
        site_dir: the host folder to mount over the interpreter's site-packages.
        distributions: ``{distribution: version}`` it holds (the allow-list's requirement closure).
        missing: allowed names not installed here (left out; a task that imports one fails).
        key: the cache key (hash of the format, the interpreter's version and ``distributions``).
    """

    site_dir: Path
    distributions: dict[str, str]
    missing: tuple[str, ...]
    key: str


def allowed_environment(packages: tuple[str, ...] | list[str], cache_dir: Path) -> AllowedEnvironment:
    """The environment holding ``packages`` (distribution names) and their requirement closure,
    built under ``cache_dir`` unless an identical build is there. An empty allow-list is an empty
    folder: the standard library only. Resolved once per process and allow-list (the installed
    versions are read then); the folder is checked to exist on every call and built again if gone.

    Raises:
        OSError: the cache folder cannot be made or written.
    """
    names = tuple(sorted({canonicalize_name(n) for n in packages}))
    env = _resolved(names, str(cache_dir))
    if not env.site_dir.is_dir():
        _resolved.cache_clear()
        env = _resolved(names, str(cache_dir))
    return env


@lru_cache(maxsize=32)
def _resolved(names: tuple[str, ...], cache_dir: str) -> AllowedEnvironment:
    installed, missing = [], []
    for name in names:
        try:
            metadata.distribution(name)
            installed.append(name)
        except metadata.PackageNotFoundError:
            missing.append(name)
    if missing:
        log.warning("sandbox allow-list: %s not installed here; tasks that import them fail", ", ".join(missing))
    closure = requirement_closure(installed)
    versions = {name: dist.version for name, dist in closure.items()}
    blob = json.dumps([ALLOWED_FORMAT, sys.implementation.cache_tag, sorted(versions.items())])
    key = hashlib.sha256(blob.encode()).hexdigest()[:16]
    root = Path(cache_dir)
    final = root / key
    if not (final / "manifest.json").is_file():
        root.mkdir(parents=True, exist_ok=True)
        with open(root / f"{key}.lock", "w") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)  # a concurrent builder of the same key finishes first
            if not (final / "manifest.json").is_file():
                _build(final, closure, versions)
    return AllowedEnvironment(final / "site-packages", versions, tuple(missing), key)


def _build(final: Path, closure: dict[str, metadata.Distribution], versions: dict[str, str]) -> None:
    """Write the closure's files under ``final/site-packages`` in a temporary folder renamed into place."""
    tmp = final.with_name(f".{final.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    site = tmp / "site-packages"
    site.mkdir(parents=True)
    for dist in closure.values():
        for rel in _site_files(dist):
            source, dest = Path(str(dist.locate_file(rel))), site / rel
            if not source.is_file() or dest.exists():
                continue
            dest.parent.mkdir(parents=True, exist_ok=True)
            try:
                os.link(source, dest)  # same filesystem: no copy (the mount is read-only either way)
            except OSError:
                shutil.copy2(source, dest)
    for d in (tmp, *(p for p in tmp.rglob("*") if p.is_dir())):
        d.chmod(0o755)  # the sandbox uid reads the tree
    (tmp / "manifest.json").write_text(json.dumps({"format": ALLOWED_FORMAT, "distributions": versions}, indent=1))
    shutil.rmtree(final, ignore_errors=True)
    tmp.rename(final)


def _site_files(dist: metadata.Distribution) -> list[str]:
    """Paths under site-packages that ``dist`` installed (its RECORD; for a distribution without one,
    every file under its top-level entries)."""
    if dist.files is not None:
        return [str(f) for f in dist.files if f.parts and f.parts[0] != ".."]
    out = []
    for top in _top_level_entries(dist):
        path = Path(str(dist.locate_file(top)))
        if path.is_file():
            out.append(top)
        elif path.is_dir():
            out += [str(p.relative_to(path.parent)) for p in path.rglob("*") if p.is_file()]
    return out

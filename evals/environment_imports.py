"""The deterministic fallback environment of a task: the allowed installed distributions that
provide the modules its Python files import (:func:`resolve_environment`), used when the model's
proposal (:mod:`evals.environments`) is refused.

Invariant: only absolute imports count (a relative one is the task's own), standard-library and
the task's own modules are skipped, and a distribution is named only when it is on the allowed
list and installed here, so the fallback never proposes what :func:`evals.environments.check_proposal`
would refuse.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from importlib import metadata
from pathlib import PurePosixPath
from typing import Any

from packaging.utils import canonicalize_name

from evals.environments import EnvironmentPolicy, EnvironmentProposal, distribution_installed
from evals.harness.environment import requirement_closure
from evals.tasks.model import Task


@lru_cache(maxsize=1)
def _module_distributions() -> dict[str, tuple[str, ...]]:
    return {m: tuple(canonicalize_name(d) for d in ds) for m, ds in metadata.packages_distributions().items()}


def imported_modules(sources: dict[str, str]) -> tuple[set[str], list[str]]:
    """Top-level names of the absolute imports in the Python ``sources`` (path -> text).

    Returns:
        ``(module names, paths that are not valid Python)``.
    """
    names: set[str] = set()
    broken: list[str] = []
    for path, text in sorted(sources.items()):
        try:
            tree = ast.parse(text, filename=path)
        except SyntaxError:
            broken.append(path)
            continue
        names |= _imports(tree, embedded=True)
    return names, broken


def _imports(tree: ast.AST, *, embedded: bool) -> set[str]:
    """Top-level names ``tree`` imports; with ``embedded``, also those of string constants that parse as
    Python with an import (a hidden-test runner execs its prelude from a string)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
        elif embedded and isinstance(node, ast.Constant) and isinstance(node.value, str) and "import " in node.value:
            try:
                names |= _imports(ast.parse(node.value), embedded=False)
            except SyntaxError:
                continue
    return names


def resolve_environment(task: Task, policy: EnvironmentPolicy) -> tuple[EnvironmentProposal, dict[str, Any]]:
    """The deterministic fallback: the allowed installed distributions that provide the modules the
    task's Python files (repository, reference, tests) import; no extra files.

    Standard-library modules and the task's own modules are skipped; a module provided by the
    requirement closure of the chosen distributions (``dateutil`` via ``pandas``) is covered.

    Returns:
        ``(canonical proposal, detail)``; detail has ``modules`` (third-party imports seen),
        ``unresolved`` (modules no allowed distribution provides) and ``unparsed`` (files not valid Python).
    """
    files = {**task.files, **task.reference_files, **task.test_files}
    modules, broken = imported_modules({p: t for p, t in files.items() if p.endswith(".py")})
    local = {PurePosixPath(p).parts[0].removesuffix(".py") for p in files}
    third_party = sorted(m for m in modules if m not in sys.stdlib_module_names and m not in local)
    provided = _module_distributions()
    deps = sorted(
        {
            next(d for d in provided[m] if d in policy.allowed)
            for m in third_party
            if set(provided.get(m, ())) & set(policy.allowed)
        }
    )
    deps = [d for d in deps if distribution_installed(d)]
    closure = requirement_closure(deps)
    unresolved = [m for m in third_party if not set(provided.get(m, ())) & set(closure)]
    detail = {"modules": third_party, "unresolved": unresolved, "unparsed": broken}
    return EnvironmentProposal(dependencies=deps, files={}).canonical(), detail

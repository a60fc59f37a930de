"""The one task format every source adapter produces (and the mined suite stores as JSON).

Invariant: a ``Task`` is self-contained — the visible repository (``files``), the hidden test
command and files, and a reference solution — so it can be rebuilt in any sandbox directory, and
``Task.model_validate(task.model_dump(mode="json"))`` round-trips.
"""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

HIDDEN_RUNNER = "_run_hidden_tests.py"


class FollowUp(BaseModel):
    """A later message of the developer in the same session, sent after the agent's final reply to
    the message before (a multi-step request).

    Attributes:
        request: what the developer asks next.
        entry_point: the function this step asks for (what the editor's Apply looks for in the
            reply); None: the task's own ``entry_point``.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    request: str
    entry_point: str | None = None


class Task(BaseModel):
    """A small repository plus a terse request, graded by hidden tests.

    Attributes:
        id: source-native id (``DFB/T0001``, ``HumanEval/0``), unique within ``source``.
        source: ``dataframebench`` | ``humaneval`` | ``mined`` | ...
        split: ``train`` (product sessions / training) or ``test`` (evals).
        request: what the developer asks the agent.
        files: the visible repository, relative POSIX path -> text.
        test_command: shell command that runs the hidden tests (exit 0 = pass), from the repo root.
        test_files: hidden files written next to the repository only for grading.
        reference_files: files that solve the task (overlaid on ``files``).
        metadata: source-specific facts (entry point, libraries, category, ...).
        followups: the developer's later messages in the same session, in order (empty: one request).
        environment: distributions its tests run with (see the field), None for the host's interpreter.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=256)
    source: str = Field(min_length=1, max_length=64)
    split: str = Field(min_length=1, max_length=32)
    request: str
    files: dict[str, str]
    test_command: str
    test_files: dict[str, str] = Field(default_factory=dict)
    reference_files: dict[str, str] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    followups: tuple[FollowUp, ...] = Field(default=(), exclude_if=lambda v: not v)
    """Left out of dumps while empty, so one-request tasks dump (and hash) as they always did."""
    environment: tuple[str, ...] | None = Field(default=None, exclude_if=lambda v: v is None)
    """Distributions the hidden tests need (canonical names), linked into the repository's
    virtualenv before the session and its grading (:mod:`evals.harness.environment`); None: the
    task runs on the sandbox's interpreter as it is. Set from a verified environment when a mined
    task is loaded (:func:`evals.tasks.mined.load_mined_tasks`); left out of dumps while None."""

    @field_validator("files", "test_files", "reference_files")
    @classmethod
    def _relative_paths(cls, v: dict[str, str]) -> dict[str, str]:
        for path in v:
            p = PurePosixPath(path)
            if p.is_absolute() or ".." in p.parts or not p.parts:
                raise ValueError(f"task file path {path!r} must be relative and inside the repository")
        return v


def hidden_runner(prelude: str, epilogue: str, test_file: str) -> str:
    """Source of a runner that executes ``solution.py`` and ``test_file`` as ONE module.

    Both sources concatenate into ``__main__`` (as DataFrameBench's and HumanEval's own harnesses
    do), so tests see every module-level name of the solution, private ones included.
    """
    return (
        "import sys\n"
        "sys.setrecursionlimit(10000)\n"
        "_src = (" + repr(prelude) + " + open('solution.py', encoding='utf-8').read() + '\\n\\n'\n"
        "        + open(" + repr(test_file) + ", encoding='utf-8').read() + " + repr(epilogue) + ")\n"
        "exec(compile(_src, 'harness', 'exec'), {'__name__': '__main__', '__builtins__': __builtins__})\n"
    )

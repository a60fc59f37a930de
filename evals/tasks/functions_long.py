"""``functions_long``: multi-step function requests in long files, sessions long enough that the
agent must self-summarize.

A task is :data:`STEPS` ``functions`` requests on distinct functions, asked one after the other in
one session (the first as the task's request, the others as ``Task.followups``, each sent after
the agent's final reply to the one before), in a repository of long files:

- ``solution.py``: many small finished functions (references of ``functions`` training tasks)
  and, last, the stubs of the requested functions;
- ``helpers.py``: more finished functions, which the requests do not touch;
- ``run_checks.py``: runs every requested function on its hidden cases and prints each result or
  its traceback, so a ``run`` of it is a long tool output while the stubs raise.

The three files are sized to be shown whole in a segment's first user turn (within
``repository_message``'s 6,000 characters): with the SmolLM2 tokenizer that turn is about 2,000
tokens, so a session under the simulator's 3,072-token context fills it within a few turns of
any length and self-summarizes (``tests/unit/test_long_sessions.py`` runs one through the harness).

The hidden test checks every requested function on its template's cases (the same check as
``functions``). Splits follow ``functions``: the requested functions of a ``test`` task come from
held-out templates, of a ``train`` task from training templates; the finished functions are
always training references. Invariant: generation is deterministic, and a task's requested entry
points are distinct and none of them is defined by a finished function.
"""

from __future__ import annotations

import ast
import random
from functools import lru_cache

from app.core.errors import ConfigurationError
from evals.tasks import functions
from evals.tasks.model import HIDDEN_RUNNER, FollowUp, Task, hidden_runner

SOURCE = "functions_long"
SPLITS = ("train", "test")
STEPS = 3
"""Requests per session."""
MAX_FILE_CHARS = 2800
"""Characters of ``solution.py`` and of ``helpers.py``, at most (``repository_message`` inlines
files up to 3,000 characters and 6,000 in all)."""
MAX_TOTAL_CHARS = 5900
"""Characters of the three files together, at most."""
TEST_FILE = "test_hidden.py"

_FOLLOW_UP = ("Thanks. Next: {request}", "Now one more thing. {request}", "Good. Also: {request}")
_CHECKS = '''"""Runs each requested function of solution.py on its test inputs and prints what it returns."""

import sys
import traceback

import solution

CALLS = {calls!r}

for name, args in CALLS:
    print(f"== {{name}}{{tuple(args)!r}}")
    try:
        print("   returned", repr(getattr(solution, name)(*args)))
    except Exception:
        traceback.print_exc(file=sys.stdout)
'''
_CALL_LINE = 13
"""The line of ``run_checks.py`` that calls the function (its tracebacks name it)."""
_STUB_TRACEBACK = """Traceback (most recent call last):
  File "run_checks.py", line {call_line}, in <module>
    print("   returned", repr(getattr(solution, name)(*args)))
                              ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^
  File "solution.py", line {stub_line}, in {name}
    raise NotImplementedError
NotImplementedError"""


def _steps(pool: list[Task], rng: random.Random) -> list[list[Task]]:
    """``pool`` shuffled and cut into groups of :data:`STEPS` tasks with distinct entry points."""
    rest = list(pool)
    rng.shuffle(rest)
    groups: list[list[Task]] = []
    while len(rest) >= STEPS:
        group: list[Task] = []
        for t in list(rest):
            if all(t.metadata["entry_point"] != g.metadata["entry_point"] for g in group):
                group.append(t)
                rest.remove(t)
            if len(group) == STEPS:
                break
        if len(group) < STEPS:
            break
        groups.append(group)
    return groups


def _fill(functions_src: list[str], limit: int) -> tuple[str, list[str]]:
    """As many of ``functions_src`` as fit in ``limit`` characters joined as a module; the rest."""
    kept: list[str] = []
    size = 0
    rest = list(functions_src)
    while rest and size + len(rest[0]) + 2 <= limit:
        src = rest.pop(0)
        kept.append(src)
        size += len(src) + 2
    return "\n\n".join(kept), rest


def _task(index: int, steps: list[Task], fillers: list[Task], split: str) -> Task:
    names = [t.metadata["entry_point"] for t in steps]
    finished = [
        t.reference_files["solution.py"].strip() + "\n" for t in fillers if t.metadata["entry_point"] not in names
    ]
    calls = [(t.metadata["entry_point"], list(args)) for t in steps for args, _ in _cases(t)]
    checks = _CHECKS.format(calls=calls)
    stubs = "\n\n".join(t.files["solution.py"].strip() + "\n" for t in steps)
    room = min(MAX_FILE_CHARS, (MAX_TOTAL_CHARS - len(checks)) // 2)
    solution_body, rest = _fill(finished, room - len(stubs) - 2)
    helpers, _ = _fill(rest, room)
    solution = f"{solution_body}\n\n{stubs}"
    lines = solution.splitlines()
    tests = "".join(t.test_files[functions.TEST_FILE] + f"\n\ncheck({t.metadata['entry_point']})\n\n" for t in steps)
    suffix = " Run `python run_checks.py` to see what the functions return."
    return Task(
        id=f"FNL/{split}/{index}",
        source=SOURCE,
        split=split,
        request=steps[0].request + suffix,
        files={"solution.py": solution, "helpers.py": helpers + "\n", "run_checks.py": checks},
        test_command=f"python {HIDDEN_RUNNER}",
        test_files={TEST_FILE: tests, HIDDEN_RUNNER: hidden_runner("", "\n", TEST_FILE)},
        reference_files={
            "solution.py": solution_body + "\n\n" + "\n\n".join(t.reference_files["solution.py"] for t in steps)
        },
        metadata={
            "entry_point": names[0],
            "entry_points": names,
            "templates": [t.metadata["template"] for t in steps],
            "difficulty": max(t.metadata["difficulty"] for t in steps),
            "family": "long",
            "steps": STEPS,
        },
        followups=tuple(
            FollowUp(
                request=_FOLLOW_UP[(index + k) % len(_FOLLOW_UP)].format(request=t.request)
                + "\n\nrun_checks.py printed this for it before you started:\n```\n"
                + _stub_output(
                    name, [args for args, _ in _cases(t)], lines.index(t.files["solution.py"].splitlines()[0]) + 2
                )
                + "\n```",
                entry_point=name,
            )
            for k, (t, name) in enumerate(zip(steps[1:], names[1:]))
        ),
    )


def _stub_output(name: str, calls: list[tuple], stub_line: int) -> str:
    """What ``run_checks.py`` prints for ``name`` while it is the stub at line ``stub_line`` of
    ``solution.py`` (its traceback for every call, as Python 3.11 prints it, paths relative)."""
    trace = _STUB_TRACEBACK.format(call_line=_CALL_LINE, stub_line=stub_line, name=name)
    return "\n".join(f"== {name}{tuple(args)!r}\n{trace}" for args in calls)


def _cases(task: Task) -> list[tuple[tuple, object]]:
    """The hidden cases of a ``functions`` task: its test file's first line, ``CASES = <literal>``."""
    head = task.test_files[functions.TEST_FILE].split("\n", 1)[0]
    return ast.literal_eval(head.removeprefix("CASES = "))


@lru_cache(maxsize=2)
def _load(split: str) -> tuple[Task, ...]:
    rng = random.Random(f"{SOURCE}:{split}")
    # the first two variants of each training template: enough finished functions to fill both files
    fillers = [t for t in functions.load("train") if t.metadata["variant"] < 2]
    out = []
    for index, steps in enumerate(_steps(functions.load(split), rng)):
        chosen = list(fillers)
        random.Random(f"{SOURCE}:{split}:{index}").shuffle(chosen)
        out.append(_task(index, steps, chosen, split))
    return tuple(out)


def load(split: str) -> list[Task]:
    """Every task of ``split`` (``train`` or ``test``), in generation order.

    Raises:
        ConfigurationError: any other split.
    """
    if split not in SPLITS:
        raise ConfigurationError(f"{SOURCE} has splits {', '.join(SPLITS)} (asked for {split!r})")
    return list(_load(split))

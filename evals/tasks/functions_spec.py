"""Template registry of the ``functions`` task source (``evals/tasks/functions.py``).

A template is a function ``(rng) -> dict`` registered with :func:`template`; each call with a
differently seeded ``random.Random`` yields one parameterisation (function name, constants,
separators, conditions). The dict holds:

- ``name``: the entry point; ``args``: its parameter list as written in the signature;
- ``what``: the behaviour, phrased after "that" in the developer's request;
- ``body``: the reference body (indented source after the ``def`` line);
- ``cases``: argument tuples for the hidden tests (expected values come from the reference).

Invariant: templates are pure functions of the rng they are given, so generation is deterministic.
"""

from __future__ import annotations

import random
import textwrap
from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Template:
    """One registered template.

    Attributes:
        key: unique template name (the split and the task ids use it).
        family: ``strings`` | ``parsing`` | ``lists`` | ``numbers`` | ``dicts``.
        difficulty: 1 (one expression) to 3 (a loop with state or several rules).
        build: ``(random.Random) -> dict`` (see the module docstring).
    """

    key: str
    family: str
    difficulty: int
    build: Callable[[random.Random], dict]


TEMPLATES: list[Template] = []
"""The templates of the ``train``, ``test`` and ``test_params`` splits, in registration order."""
FRESH_TEMPLATES: list[Template] = []
"""The templates of the ``fresh`` split (``evals/tasks/functions_fresh.py``): kinds of request no
other split has."""

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "ocean", "maple", "robot", "sugar", "delta"]
"""Words the ``strings`` and ``parsing`` templates build their cases from."""


def template(family: str, difficulty: int, registry: list[Template] | None = None) -> Callable:
    """Register the decorated ``(rng) -> dict`` function as a template named after it, in
    ``registry`` (default :data:`TEMPLATES`)."""

    def deco(fn: Callable[[random.Random], dict]) -> Callable[[random.Random], dict]:
        (TEMPLATES if registry is None else registry).append(Template(fn.__name__.lstrip("_"), family, difficulty, fn))
        return fn

    return deco


def body(src: str) -> str:
    """Dedent ``src`` and indent it by four spaces (a function body)."""
    return textwrap.indent(textwrap.dedent(src).strip("\n"), "    ") + "\n"


def spec(name: str, args: str, what: str, src: str, cases: list[tuple]) -> dict:
    """The dict a template returns (``src`` is the body, dedented here)."""
    return {"name": name, "args": args, "what": what, "body": body(src), "cases": cases}


def ints(r: random.Random, n: int, lo: int = -9, hi: int = 20) -> list[int]:
    """``n`` random ints in ``[lo, hi]`` (repeats allowed)."""
    return [r.randint(lo, hi) for _ in range(n)]

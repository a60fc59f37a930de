"""``functions``: small function requests, as a developer asks them in an editor, with hidden tests.

Each task asks for one Python function in ``solution.py`` (which holds its stub), e.g. "Add a
function `count_vowels(s)` to solution.py that returns how many vowels ...". Tasks come from the
parametrised templates of ``functions_basic.py`` (difficulty 1, every family) and of one module per
family: ``functions_lists.py``, ``functions_numbers.py``, ``functions_dicts.py``,
``functions_strings.py`` and ``functions_parsing.py`` (``difficulty`` 1-3); each template yields up to
:data:`VARIANTS` distinct parameterisations (function name, constants, separators, conditions).
The hidden test calls the entry point on the template's cases and compares with what the
reference returns on them (floats within 1e-6), so a reference passes by construction and the
stub, which raises ``NotImplementedError``, fails.

Splits (by template, so held-out tasks are ones the trainer never saw in any form):

- ``test``: every variant of the held-out templates (every 4th template of each difficulty level,
  in registration order, so the levels are mixed alike);
- ``train``: the first :data:`TRAIN_VARIANTS` variants of the other templates;
- ``test_params``: up to :data:`PARAM_VARIANTS` further variants of each training template whose
  behaviour is new: on the variant's hidden cases no training variant's reference (nor an earlier
  ``test_params`` variant's) returns what the variant's reference returns, so a renamed training
  solution fails them (unseen parameterisations, not renamed training tasks). Most are still a
  one- or two-token edit of a trained request;
- ``fresh``: up to :data:`FRESH_VARIANTS` variants of each template of ``functions_fresh.py``,
  kinds of request no other split has (fresh traffic for the A/B: no request is a few-token edit
  of a trained one, tests/unit/test_functions_tasks.py).

Invariant: generation is deterministic (every template is seeded by ``"<template>:<attempt>"``)
and the three splits are disjoint; ``test_params`` is disjoint from ``train`` in behaviour too.
"""

from __future__ import annotations

import copy
import random
from functools import lru_cache

from app.core.errors import ConfigurationError
from evals.tasks.functions_spec import FRESH_TEMPLATES, TEMPLATES, Template
from evals.tasks.model import HIDDEN_RUNNER, Task, hidden_runner

# Each import registers its templates; registration order decides the held-out templates, so it stays fixed.
# isort: off
from evals.tasks import (
    functions_basic,  # noqa: F401
    functions_lists,  # noqa: F401
    functions_numbers,  # noqa: F401
    functions_dicts,  # noqa: F401
    functions_strings,  # noqa: F401
    functions_parsing,  # noqa: F401
    functions_fresh,  # noqa: F401  (its own registry: the order above is untouched)
)
# isort: on

SOURCE = "functions"
SPLITS = ("train", "test", "test_params", "fresh")
VARIANTS = 6
TRAIN_VARIANTS = 4
PARAM_VARIANTS = 4
FRESH_VARIANTS = 4
HELD_OUT_EVERY = 4
TEST_FILE = "test_hidden.py"
_ATTEMPTS = 40

_OPENERS = (
    "Add a function `{sig}` to solution.py that {what}.",
    "Write `{sig}` in solution.py: it {what}.",
    "Can you implement `{sig}`? It {what}.",
    "I need a function `{sig}` that {what}.",
    "Please fill in `{sig}` in solution.py so that it {what}.",
)

_CHECK = """import copy


def _same(got, want):
    if isinstance(want, float) or isinstance(got, float):
        return isinstance(got, (int, float)) and abs(got - want) < 1e-6
    return got == want


def check(candidate):
    for args, want in CASES:
        got = candidate(*copy.deepcopy(args))
        assert _same(got, want), f"{candidate.__name__}{args!r} returned {got!r}, expected {want!r}"
"""


def template_of(task_id: str) -> str | None:
    """The template a ``functions`` task was generated from (``FN/<template>/<variant>`` ->
    ``FN/<template>``), None for any other task id: the unit the gate clusters by."""
    parts = task_id.split("/")
    return "/".join(parts[:2]) if len(parts) == 3 and parts[0] == "FN" else None


def held_out_templates() -> frozenset[str]:
    """Keys of the templates whose every task is in the ``test`` split (never trained on)."""
    ordered = sorted(TEMPLATES, key=lambda t: t.difficulty)  # stable: registration order within a level
    return frozenset(t.key for i, t in enumerate(ordered, 1) if i % HELD_OUT_EVERY == 0)


def _variants(t: Template, limit: int | None = VARIANTS) -> list[tuple[int, dict]]:
    """Up to ``limit`` (None: every one within ``_ATTEMPTS`` seeds) distinct parameterisations
    ``(attempt, spec)`` of a template, in attempt order."""
    out, keys = [], set()
    for attempt in range(_ATTEMPTS):
        s = t.build(random.Random(f"{t.key}:{attempt}"))
        key = (s["name"], s["what"], s["body"])
        if key not in keys:
            keys.add(key)
            out.append((attempt, s))
        if len(out) == limit:
            break
    return out


def _reference(s: dict):
    """The spec's reference function (our own template source, not user input)."""
    namespace: dict = {}
    exec(compile(f"def {s['name']}({s['args']}):\n{s['body']}", "<reference>", "exec"), namespace)
    return namespace[s["name"]]


def _expected_cases(s: dict) -> list[tuple[tuple, object]]:
    """The hidden test's ``CASES`` of spec ``s``: each argument tuple with the reference's result."""
    fn = _reference(s)
    return [(tuple(c), fn(*copy.deepcopy(c))) for c in s["cases"]]


def _passes(fn, cases: list[tuple[tuple, object]]) -> bool:
    """Whether ``fn`` passes the hidden test's ``check`` (the same code) on ``cases``."""
    namespace: dict = {"CASES": cases}
    exec(_CHECK, namespace)  # our own test source
    try:
        namespace["check"](fn)
    except Exception:  # a wrong result, or a reference of other parameters rejecting these inputs
        return False
    return True


def _param_variants(variants: list[tuple[int, dict]]) -> list[tuple[int, int, dict]]:
    """``(index, attempt, spec)`` of up to ``PARAM_VARIANTS`` variants after the first
    ``TRAIN_VARIANTS`` whose hidden cases no earlier kept variant's reference passes."""
    kept = [_reference(s) for _, s in variants[:TRAIN_VARIANTS]]
    out = []
    for index, (attempt, s) in enumerate(variants[TRAIN_VARIANTS:], TRAIN_VARIANTS):
        cases = _expected_cases(s)
        if any(_passes(other, cases) for other in kept):
            continue
        kept.append(_reference(s))
        out.append((index, attempt, s))
        if len(out) == PARAM_VARIANTS:
            break
    return out


def _task(t: Template, index: int, attempt: int, s: dict, split: str) -> Task:
    name, args = s["name"], s["args"]
    reference = f"def {name}({args}):\n{s['body']}"
    cases = _expected_cases(s)
    r = random.Random(f"{t.key}:{attempt}:request")
    sig = f"{name}({args})"
    request = r.choice(_OPENERS).format(sig=sig, what=s["what"])
    shown = r.choice([c for c in cases if c[1] not in (None, "", [], {})] or cases)
    call = f"{name}({', '.join(repr(a) for a in shown[0])})"
    request += f" For example, {call} should return {shown[1]!r}."
    tests = f"CASES = {cases!r}\n\n{_CHECK}"
    return Task(
        id=f"FN/{t.key}/{index}",
        source=SOURCE,
        split=split,
        request=request,
        files={"solution.py": f"def {name}({args}):\n    raise NotImplementedError\n"},
        test_command=f"python {HIDDEN_RUNNER}",
        test_files={TEST_FILE: tests, HIDDEN_RUNNER: hidden_runner("", f"\n\ncheck({name})\n", TEST_FILE)},
        reference_files={"solution.py": reference},
        metadata={
            "entry_point": name,
            "template": t.key,
            "difficulty": t.difficulty,
            "family": t.family,
            "variant": index,
        },
    )


@lru_cache(maxsize=1)
def _all() -> dict[str, tuple[Task, ...]]:
    held = held_out_templates()
    splits: dict[str, list[Task]] = {s: [] for s in SPLITS}
    for t in TEMPLATES:
        if t.key in held:
            splits["test"] += [_task(t, i, attempt, s, "test") for i, (attempt, s) in enumerate(_variants(t))]
            continue
        variants = _variants(t, limit=None)
        for index, (attempt, s) in enumerate(variants[:TRAIN_VARIANTS]):
            splits["train"].append(_task(t, index, attempt, s, "train"))
        for index, attempt, s in _param_variants(variants):
            splits["test_params"].append(_task(t, index, attempt, s, "test_params"))
    for t in FRESH_TEMPLATES:
        splits["fresh"] += [
            _task(t, i, attempt, s, "fresh") for i, (attempt, s) in enumerate(_variants(t, FRESH_VARIANTS))
        ]
    return {k: tuple(v) for k, v in splits.items()}


def load(split: str) -> list[Task]:
    """Every task of ``split`` (``train``, ``test``, ``test_params`` or ``fresh``), in template order.

    Raises:
        ConfigurationError: any other split.
    """
    if split not in SPLITS:
        raise ConfigurationError(f"functions has splits {', '.join(SPLITS)} (asked for {split!r})")
    return list(_all()[split])

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

Splits (by template, so held-out tasks are ones the trainer never saw in any form). Each template's
split is data: ``evals/functions_splits.toml`` names it, by the template's name
(:func:`template_splits`), so registering a template never moves another across:

- ``test``: every variant of the templates listed ``test`` (held out for the gate);
- ``train``: the first :data:`TRAIN_VARIANTS` variants of the templates listed ``train``;
- ``test_params``: up to :data:`PARAM_VARIANTS` further variants of each training template whose
  behaviour is new: on the variant's hidden cases no training variant's reference (nor an earlier
  ``test_params`` variant's) returns what the variant's reference returns, so a renamed training
  solution fails them (unseen parameterisations, not renamed training tasks). Most are still a
  one- or two-token edit of a trained request;
- ``fresh``: every variant of the templates listed ``fresh``: kinds no cycle trains on at the
  production level mix, each reference at least :data:`FRESH_MIN_SKELETON_DISTANCE` code-skeleton
  tokens from every training task's (fresh traffic for the A/B at production difficulty);
- ``fresh_hard``: up to :data:`FRESH_VARIANTS` variants of each template listed ``fresh_hard``
  (``functions_fresh.py``'s): kinds of request no other split has, which the base model rarely solves
  (the ``fresh`` split before 2026-12-02; no request is a few-token edit of a trained one).

Invariant: generation is deterministic (every template is seeded by ``"<template>:<attempt>"``)
and the splits are disjoint; ``test_params`` is disjoint from ``train`` in behaviour too.
"""

from __future__ import annotations

import copy
import random
import tomllib
from collections.abc import Mapping, Sequence
from functools import lru_cache
from pathlib import Path

from app.core.errors import ConfigurationError

# Each import registers its templates; evals/functions_splits.toml, not the order, names their splits.
from evals.tasks import (  # noqa: F401
    functions_basic,
    functions_dicts,
    functions_fresh,
    functions_lists,
    functions_numbers,
    functions_parsing,
    functions_strings,
)
from evals.tasks.functions_spec import FRESH_TEMPLATES, TEMPLATES, Template
from evals.tasks.model import HIDDEN_RUNNER, Task, hidden_runner

SOURCE = "functions"
TEMPLATE_SPLITS = ("train", "test", "report", "fresh", "fresh_hard")
"""The values ``evals/functions_splits.toml`` may give a template."""
SPLITS = ("train", "test", "test_params", "report", "fresh", "fresh_hard")
SPLITS_FILE = Path(__file__).resolve().parents[1] / "functions_splits.toml"
VARIANTS = 6
TRAIN_VARIANTS = 4
PARAM_VARIANTS = 4
FRESH_VARIANTS = 4
FRESH_MIN_SKELETON_DISTANCE = 3
"""Code-skeleton tokens (evals/tasks/skeleton.py) every ``fresh`` reference is at least from every
training task's: more than a renamed trained one (0) or one with an operator swapped (1-2)."""
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


def template_splits(templates: Sequence[Template], table: Mapping[str, str]) -> dict[str, str]:
    """Each template's split, ``{key: split}`` in ``table``'s order, read from ``table`` (``{template
    key: split}``) by key alone: a template's split depends on its own entry only, never on the
    others or on the order templates registered in.

    Raises:
        ConfigurationError: a template the table does not list, a listed name no template has, or a
            split outside :data:`TEMPLATE_SPLITS`.
    """
    keys = {t.key for t in templates}
    unlisted = sorted(keys - set(table))
    unknown = sorted(set(table) - keys)
    bad = sorted(f"{k} = {v!r}" for k, v in table.items() if v not in TEMPLATE_SPLITS)
    if unlisted or unknown or bad:
        raise ConfigurationError(
            f"{SPLITS_FILE.name}: "
            + "; ".join(
                part
                for part in (
                    f"templates not listed: {', '.join(unlisted)}" if unlisted else "",
                    f"listed but not registered: {', '.join(unknown)}" if unknown else "",
                    f"splits other than {', '.join(TEMPLATE_SPLITS)}: {', '.join(bad)}" if bad else "",
                )
                if part
            )
        )
    return {key: split for key, split in table.items()}


@lru_cache(maxsize=1)
def split_table() -> dict[str, str]:
    """``[templates]`` of ``evals/functions_splits.toml``: ``{template key: split}``."""
    with SPLITS_FILE.open("rb") as fh:
        return dict(tomllib.load(fh)["templates"])


def splits_of_templates() -> dict[str, str]:
    """Every registered template's split (:func:`template_splits` over the shipped table)."""
    return template_splits([*TEMPLATES, *FRESH_TEMPLATES], split_table())


def templates_in(split: str) -> frozenset[str]:
    """Keys of the templates ``evals/functions_splits.toml`` puts in ``split``."""
    return frozenset(k for k, s in splits_of_templates().items() if s == split)


def held_out_templates() -> frozenset[str]:
    """Keys of the templates whose every task is in the ``test`` split (held out for the gate)."""
    return templates_in("test")


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


HELD_VARIANTS = {"test": VARIANTS, "report": VARIANTS, "fresh": VARIANTS, "fresh_hard": FRESH_VARIANTS}
"""Variants per template of each split whose templates are never trained on."""


@lru_cache(maxsize=1)
def _all() -> dict[str, tuple[Task, ...]]:
    by_key = {t.key: t for t in [*TEMPLATES, *FRESH_TEMPLATES]}
    splits: dict[str, list[Task]] = {s: [] for s in SPLITS}
    for key, split in splits_of_templates().items():  # the table's order: the same whatever the imports
        t = by_key[key]
        if split != "train":
            held = enumerate(_variants(t, HELD_VARIANTS[split]))
            splits[split] += [_task(t, i, attempt, s, split) for i, (attempt, s) in held]
            continue
        variants = _variants(t, limit=None)
        for index, (attempt, s) in enumerate(variants[:TRAIN_VARIANTS]):
            splits["train"].append(_task(t, index, attempt, s, "train"))
        for index, attempt, s in _param_variants(variants):
            splits["test_params"].append(_task(t, index, attempt, s, "test_params"))
    return {k: tuple(v) for k, v in splits.items()}


def load(split: str) -> list[Task]:
    """Every task of ``split`` (one of :data:`SPLITS`), in the order ``evals/functions_splits.toml``
    lists the templates.

    Raises:
        ConfigurationError: any other split.
    """
    if split not in SPLITS:
        raise ConfigurationError(f"functions has splits {', '.join(SPLITS)} (asked for {split!r})")
    return list(_all()[split])

"""The ``functions`` templates' splits are data (``evals/functions_splits.toml``), pinned here by name:
no import, registration order or new template moves a template across splits (issue 68, item 5)."""

from __future__ import annotations

import pytest

from app.core.errors import ConfigurationError
from evals.tasks import functions
from evals.tasks.functions_spec import FRESH_TEMPLATES, TEMPLATES, Template

# The gate's held-out templates, as they were chosen (every 4th template of each level, 2026-11-24).
HELD_OUT = {
    "acronym", "binary_repr", "caesar", "count_char_class", "count_prefixed_lines", "count_value", "dict_keys",
    "fizzbuzz", "gcd_lcm", "interleave", "keys_by_value", "neighbour_diffs", "only_digits", "pick_element",
    "repeat_joined", "second_extreme", "series_sum", "sign_check", "special_number", "string_basic", "truncate",
}  # fmt: skip
# Fresh traffic at production difficulty, chosen 2026-12-02 from the training population at the
# production level mix, far in code skeleton from what stays trained.
FRESH = {
    "clock_to_units", "count_by_parity", "list_extreme", "map_each", "mask_tail", "nested_get", "power",
    "product", "reverse_list", "reverse_words", "rotate", "word_lengths",
}  # fmt: skip
# Held out and never gated (the bench's held-out figure), chosen 2026-12-02 across families and levels.
REPORT = {
    "average", "dedupe", "flatten", "greet", "index_of_extreme", "invert", "is_prime", "longest_run",
    "longest_word", "parse_duration", "sorted_copy", "sum_listed",
}  # fmt: skip
# The fresh split before 2026-12-02 (functions_fresh.py), which base solves 4-5 % of.
FRESH_HARD = {
    "alternate_case", "count_between", "count_fields", "count_prefixed_keys", "digital_root", "last_n",
    "middle_char", "pairwise", "parse_percent", "percent_of", "surround", "top_keys",
}  # fmt: skip


def test_the_shipped_table_names_every_template_once_and_is_pinned():
    of = functions.splits_of_templates()
    assert set(of) == {t.key for t in [*TEMPLATES, *FRESH_TEMPLATES]}
    assert functions.templates_in("test") == HELD_OUT == functions.held_out_templates()
    assert functions.templates_in("report") == REPORT
    assert functions.templates_in("fresh") == FRESH
    assert functions.templates_in("fresh_hard") == FRESH_HARD
    assert functions.templates_in("train") == set(of) - HELD_OUT - REPORT - FRESH - FRESH_HARD
    for split in functions.TEMPLATE_SPLITS:  # the tasks follow the table
        assert {t.metadata["template"] for t in functions.load(split)} == functions.templates_in(split)


def _template(key: str) -> Template:
    return Template(key, "lists", 1, lambda r: {})


def test_adding_a_template_never_moves_another():
    templates = [*TEMPLATES, *FRESH_TEMPLATES]
    table = functions.split_table()
    before = functions.template_splits(templates, table)
    for split in functions.TEMPLATE_SPLITS:  # a new template anywhere in the order, in any split
        for at in (0, len(templates) // 2, len(templates)):
            grown = [*templates[:at], _template("brand_new"), *templates[at:]]
            after = functions.template_splits(grown, {**table, "brand_new": split})
            assert after.pop("brand_new") == split
            assert after == before
    # and the order of registration plays no part
    assert functions.template_splits(list(reversed(templates)), table) == before


def test_an_unlisted_or_unknown_template_or_split_refuses_to_load():
    templates = [*TEMPLATES, *FRESH_TEMPLATES]
    table = functions.split_table()
    with pytest.raises(ConfigurationError, match="templates not listed: brand_new"):
        functions.template_splits([*templates, _template("brand_new")], table)
    with pytest.raises(ConfigurationError, match="listed but not registered: gone"):
        functions.template_splits(templates, {**table, "gone": "train"})
    with pytest.raises(ConfigurationError, match="splits other than"):
        functions.template_splits(templates, {**table, "arithmetic": "validation"})


def test_fresh_is_far_from_every_training_task_in_code_skeleton_and_sized_for_its_pairs():
    """Issue 70, item 4: every ``fresh`` task's reference is at least ``FRESH_MIN_SKELETON_DISTANCE``
    code-skeleton tokens from every training task's (names and constants set aside: a renamed trained
    task is 0 away); its levels follow the production mix; its suite has >= 300 (task, sample) pairs."""
    from evals.config import load_suite
    from evals.tasks.skeleton import skeleton_distance

    train = [t.reference_files["solution.py"] for t in functions.load("train")]
    fresh = functions.load("fresh")
    nearest = [min(skeleton_distance(t.reference_files["solution.py"], r) for r in train) for t in fresh]
    assert min(nearest) >= functions.FRESH_MIN_SKELETON_DISTANCE == 3
    levels = [t.metadata["difficulty"] for t in fresh]
    assert levels.count(1) / len(levels) == pytest.approx(0.6, abs=0.1)  # ops.simulator.PRODUCTION_MIX
    suite = load_suite("functions_fresh")
    assert suite.split == "fresh" and suite.sampling.temperature == 0.7
    assert len(fresh) * suite.samples_per_task >= 300
    # the measure itself: renaming and new constants are free, a changed operation is not
    assert skeleton_distance("def f(a, b):\n    return a + b\n", "def add(x, y):\n    return x + y\n") == 0
    assert skeleton_distance("def f(a):\n    return a * 3\n", "def g(b):\n    return b - 7\n") == 1
    assert skeleton_distance("def f(s):\n    return s[::-1]\n", "def f(s):\n    return len(s)\n") >= 3

"""``functions`` templates of the ``fresh`` split: new kinds of request in every family, never trained
on and apart from the held-out ``test`` templates (fresh traffic for the A/B).

They register in :data:`evals.tasks.functions_spec.FRESH_TEMPLATES`; ``evals/functions_splits.toml``
names each one's split.
Levels follow the production request mix (mostly one-expression requests): eight at level 1,
three at level 2, one at level 3.
"""

from __future__ import annotations

from evals.tasks.functions_spec import FRESH_TEMPLATES, ints, spec, template

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "ocean"]


def fresh(family: str, difficulty: int):
    """Register a template of the ``fresh`` split."""
    return template(family, difficulty, registry=FRESH_TEMPLATES)


@fresh("strings", 1)
def surround(r):
    left, right, word = r.choice(
        [
            ("(", ")", "parentheses"),
            ("[", "]", "square brackets"),
            ("<", ">", "angle brackets"),
            ("*", "*", "asterisks"),
        ]
    )
    name = r.choice(["surround", "wrap", "enclose", "bracket"])
    return spec(
        name,
        "s",
        f"returns s wrapped in {word}, i.e. {left!r} before it and {right!r} after it",
        f"return {left!r} + s + {right!r}",
        [("hi",), ("",), ("a b",)],
    )


@fresh("strings", 1)
def middle_char(r):
    side, expr = r.choice([("left", "s[(len(s) - 1) // 2]"), ("right", "s[len(s) // 2]")])
    name = r.choice(["middle_char", "center_letter", "middle_of"])
    return spec(
        name,
        "s",
        f"returns the middle character of the non-empty string s (for an even length, the {side} one of the two middle characters)",
        f"return {expr}",
        [("abc",), ("abcd",), ("x",), ("stone",), ("piano!",)],
    )


@fresh("strings", 2)
def alternate_case(r):
    first, rest = r.choice([("upper", "lower"), ("lower", "upper")])
    name = r.choice(["alternate_case", "zigzag_case", "spongebob"])
    return spec(
        name,
        "s",
        f"returns s with the characters at even positions (0, 2, ...) in {first} case and the others in {rest} case",
        f"return ''.join(c.{first}() if i % 2 == 0 else c.{rest}() for i, c in enumerate(s))",
        [("hello",), ("",), ("AbCd EF",)],
    )


@fresh("parsing", 1)
def count_fields(r):
    sep, word = r.choice([(",", "commas"), (";", "semicolons"), ("|", "vertical bars"), (":", "colons")])
    name = r.choice(["count_fields", "field_count", "num_columns"])
    return spec(
        name,
        "line",
        f"returns how many fields the line has when split on {word} ({sep!r}); an empty line has 0 fields",
        f"return len(line.split({sep!r})) if line else 0",
        [(f"a{sep}b{sep}c",), ("",), ("one",), (f"{sep}{sep}",)],
    )


@fresh("parsing", 1)
def parse_percent(r):
    as_fraction = r.choice([True, False])
    name = r.choice(["parse_percent", "percent_value", "from_percent"])
    what = 'as a fraction ("45%" gives 0.45)' if as_fraction else 'as a float number ("45%" gives 45.0)'
    expr = "float(text.strip().rstrip('%')) / 100" if as_fraction else "float(text.strip().rstrip('%'))"
    return spec(
        name,
        "text",
        f'takes a percentage written like "45%" (maybe with spaces around) and returns its value {what}',
        f"return {expr}",
        [("45%",), (" 7.5% ",), ("100%",), ("0%",)],
    )


@fresh("lists", 1)
def count_between(r):
    lo = r.randint(-3, 3)
    hi = lo + r.randint(2, 8)
    name = r.choice(["count_between", "count_in_range", "how_many_between"])
    return spec(
        name,
        "xs",
        f"returns how many numbers of the list xs are between {lo} and {hi}, both included",
        f"return sum(1 for x in xs if {lo} <= x <= {hi})",
        [(ints(r, 8),), ([],), ([lo, hi, lo - 1, hi + 1],)],
    )


@fresh("lists", 1)
def last_n(r):
    n = r.randint(1, 4)
    name = r.choice([f"last_{n}", "tail_items", "take_last"])
    return spec(
        name,
        "xs",
        f"returns a list of the last {n} items of the list xs (all of them when it is shorter)",
        f"return xs[-{n}:]",
        [([1, 2, 3, 4, 5, 6],), ([],), (["a"],)],
    )


@fresh("lists", 2)
def pairwise(r):
    what, expr = r.choice(
        [("the larger", "max(a, b)"), ("the smaller", "min(a, b)"), ("the sum", "a + b"), ("the product", "a * b")]
    )
    name = r.choice(["pairwise", "combine_lists", "elementwise"])
    return spec(
        name,
        "xs, ys",
        f"returns a list with, at each position, {what} of the items of xs and ys there (stopping at the shorter list)",
        f"return [{expr} for a, b in zip(xs, ys)]",
        [([1, 5, 3], [4, 2, 6]), ([], [1]), ([-2, 0], [-3, 9, 9])],
    )


@fresh("numbers", 1)
def percent_of(r):
    p = r.choice([5, 10, 15, 20, 25, 12.5])
    name = r.choice(["percent_of", "tip", "share_of"])
    return spec(
        name,
        "amount",
        f"returns {p} percent of amount, rounded to 2 decimals",
        f"return round(amount * {p} / 100, 2)",
        [(80,), (19.99,), (0,), (1234.5,)],
    )


@fresh("numbers", 2)
def digital_root(r):
    name = r.choice(["digital_root", "repeated_digit_sum", "root_digit"])
    return spec(
        name,
        "n",
        "takes a non-negative int n and sums its decimal digits, again and again, until one digit is left; returns that digit",
        "while n >= 10:\n    n = sum(int(d) for d in str(n))\nreturn n",
        [(0,), (9,), (38,), (99999,), (123456789,)],
    )


@fresh("dicts", 1)
def count_prefixed_keys(r):
    prefix = r.choice(["a", "x_", "tmp", "is_"])
    name = r.choice(["count_prefixed_keys", "keys_starting_with", "prefix_count"])
    return spec(
        name,
        "d",
        f"returns how many keys of the dict d (all strings) start with {prefix!r}",
        f"return sum(1 for k in d if k.startswith({prefix!r}))",
        [({prefix + "1": 1, "b": 2, prefix + "z": 3},), ({},), ({"q": 0},)],
    )


@fresh("dicts", 3)
def top_keys(r):
    n = r.randint(1, 3)
    order, key = r.choice([("largest", "(-d[k], k)"), ("smallest", "(d[k], k)")])
    name = r.choice([f"top_{n}_keys", "best_keys", "rank_keys"])
    return spec(
        name,
        "d",
        f"returns a list of the (at most) {n} keys of the dict d with the {order} values, {order} first; "
        "keys with equal values in ascending order",
        f"return sorted(d, key=lambda k: {key})[:{n}]",
        [({w: v for w, v in zip(WORDS, ints(r, 6, 0, 5))},), ({},), ({"b": 1, "a": 1, "c": 2},)],
    )

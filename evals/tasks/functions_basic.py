"""``functions`` templates a beginner writes in one line (difficulty 1), in every family."""

from __future__ import annotations

from evals.tasks.functions_spec import ints, spec, template

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "ocean"]


@template("numbers", 1)
def arithmetic(r):
    what, expr, name = r.choice(
        [
            ("the sum of a and b", "a + b", "add"),
            ("a minus b", "a - b", "subtract"),
            ("the product of a and b", "a * b", "multiply"),
            ("the absolute difference between a and b", "abs(a - b)", "distance"),
            ("the larger of a and b", "max(a, b)", "larger"),
            ("the smaller of a and b", "min(a, b)", "smaller"),
        ]
    )
    name = r.choice([name, name + "_numbers", name + "_two"])
    return spec(name, "a, b", f"returns {what}", f"return {expr}", [(2, 3), (-4, 9), (0, 0), (10, -10), (7, 7)])


@template("numbers", 1)
def power(r):
    k, word = r.choice([(2, "square"), (3, "cube"), (4, "fourth power")])
    name = r.choice([word.replace(" ", "_"), f"to_the_{k}", f"power_{k}"])
    return spec(
        name, "x", f"returns the {word} of x (x to the power {k})", f"return x ** {k}", [(2,), (-3,), (0,), (10,)]
    )


@template("numbers", 1)
def divisible(r):
    k = r.choice([2, 3, 5, 7, 10])
    word = {2: "even", 3: "divisible_by_3", 5: "divisible_by_5", 7: "divisible_by_7", 10: "multiple_of_10"}[k]
    name = r.choice([f"is_{word}", f"check_{word}"])
    return spec(
        name,
        "n",
        f"returns True if the integer n is divisible by {k}, else False",
        f"return n % {k} == 0",
        [(k * 3,), (k + 1,), (0,), (-k,), (k * 7 + 1,)],
    )


@template("numbers", 1)
def sign_check(r):
    word, expr = r.choice(
        [
            ("positive (greater than 0)", "x > 0"),
            ("negative (less than 0)", "x < 0"),
            ("between 1 and 10 inclusive", "1 <= x <= 10"),
            ("zero", "x == 0"),
        ]
    )
    name = r.choice(["is_" + word.split()[0], "check_" + word.split()[0]])
    return spec(
        name, "x", f"returns True if x is {word}, else False", f"return {expr}", [(5,), (-2,), (0,), (10,), (11,), (1,)]
    )


@template("numbers", 1)
def average(r):
    name = r.choice(["average", "mean", "avg"])
    return spec(
        name,
        "numbers",
        "returns the average (arithmetic mean) of the non-empty list of numbers",
        "return sum(numbers) / len(numbers)",
        [([1, 2, 3, 4],), ([5],), (ints(r, 5),), ([2, 4],)],
    )


@template("lists", 1)
def list_extreme(r):
    which, fn = r.choice([("largest", "max"), ("smallest", "min")])
    name = r.choice([f"{which}", f"find_{which}", f"{fn}_value"])
    return spec(
        name,
        "numbers",
        f"returns the {which} number in the non-empty list numbers",
        f"return {fn}(numbers)",
        [([3, 9, 2],), ([5],), (ints(r, 6),), ([-1, -7],)],
    )


@template("lists", 1)
def map_each(r):
    word, expr = r.choice(
        [
            ("doubled", "x * 2"),
            ("squared", "x * x"),
            ("plus one", "x + 1"),
            ("negated", "-x"),
            ("halved (integer division by 2)", "x // 2"),
        ]
    )
    name = r.choice(["transform", "map_values", "apply_all"])
    return spec(
        name,
        "numbers",
        f"returns a new list with every number of the list {word}",
        f"return [{expr} for x in numbers]",
        [([1, 2, 3],), ([],), (ints(r, 5),)],
    )


@template("lists", 1)
def pick_element(r):
    which, expr = r.choice(
        [
            ("first", "items[0]"),
            ("last", "items[-1]"),
            ("second", "items[1]"),
            ("middle (at index len(items) // 2)", "items[len(items) // 2]"),
        ]
    )
    name = r.choice([f"{which.split()[0]}_item", f"get_{which.split()[0]}"])
    return spec(
        name,
        "items",
        f"returns the {which} element of the list items (it has at least two elements)",
        f"return {expr}",
        [([1, 2, 3],), (["a", "b"],), (ints(r, 6),)],
    )


@template("lists", 1)
def contains(r):
    name = r.choice(["contains", "has_value", "includes"])
    return spec(
        name,
        "items, value",
        "returns True if value is an element of the list items, else False",
        "return value in items",
        [([1, 2, 3], 2), ([], 1), (["a"], "b"), (ints(r, 5), 100)],
    )


@template("lists", 1)
def reverse_list(r):
    name = r.choice(["reverse_list", "reversed_items", "backwards"])
    return spec(
        name,
        "items",
        "returns a new list with the elements of items in reverse order",
        "return items[::-1]",
        [([1, 2, 3],), ([],), (["a", "b"],)],
    )


@template("lists", 1)
def sorted_copy(r):
    order, rev = r.choice([("ascending", "False"), ("descending", "True")])
    name = r.choice(["sort_numbers", f"sorted_{order[:3]}", "in_order"])
    return spec(
        name,
        "numbers",
        f"returns a new list with the numbers sorted in {order} order",
        f"return sorted(numbers, reverse={rev})",
        [([3, 1, 2],), ([],), (ints(r, 6),)],
    )


@template("strings", 1)
def string_basic(r):
    what, expr, name = r.choice(
        [
            ("the number of characters in s", "len(s)", "length"),
            ("s reversed", "s[::-1]", "reverse"),
            ("s in upper case", "s.upper()", "shout"),
            ("s without spaces at its start and end", "s.strip()", "trim"),
            ("the first character of s ('' for an empty string)", "s[:1]", "first_char"),
        ]
    )
    name = r.choice([name, name + "_text", name + "_string"])
    return spec(name, "s", f"returns {what}", f"return {expr}", [("hello",), ("",), ("  a b  ",), ("Ab c",)])


@template("strings", 1)
def join_two(r):
    sep = r.choice([" ", "-", ", ", ""])
    name = r.choice(["join_two", "combine", "glue"])
    return spec(
        name,
        "a, b",
        f"returns the strings a and b joined with {sep!r} between them",
        f"return a + {sep!r} + b",
        [("hello", "world"), ("", "x"), ("a", "")],
    )


@template("strings", 1)
def greet(r):
    word = r.choice(["Hello", "Hi", "Welcome", "Goodbye"])
    end = r.choice(["!", ".", ""])
    name = r.choice(["greet", "greeting", "say_" + word.lower()])
    return spec(
        name,
        "name",
        f"returns the string {word!r} followed by a comma, a space, name and {end!r}, e.g. '{word}, Ann{end}'",
        f"return '{word}, ' + name + {end!r}",
        [("Ann",), ("Bob",), ("",)],
    )


@template("dicts", 1)
def dict_lookup(r):
    default = r.choice([0, -1, "''", "None"])
    name = r.choice(["lookup", "get_value", "value_of"])
    return spec(
        name,
        "d, key",
        f"returns the value of key in the dict d, or {default} when key is missing",
        f"return d.get(key, {default})",
        [({"a": 1}, "a"), ({}, "x"), ({"k": "v", "z": 2}, "z")],
    )


@template("dicts", 1)
def dict_keys(r):
    which, expr = r.choice(
        [
            ("keys", "list(d.keys())"),
            ("values", "list(d.values())"),
            ("number of entries", "len(d)"),
            ("sum of the values", "sum(d.values())"),
        ]
    )
    name = r.choice([which.split()[-1] + "_of", "dict_" + which.split()[-1]])
    return spec(
        name,
        "d",
        f"returns the {which} of the dict d" + (" as a list, in order" if "list" in expr else ""),
        f"return {expr}",
        [({"a": 1, "b": 2},), ({},), ({"x": 5},)],
    )


@template("dicts", 1)
def make_dict(r):
    which, expr = r.choice(
        [
            ("each word to its length", "{w: len(w) for w in words}"),
            ("each word to its upper-case form", "{w: w.upper() for w in words}"),
            ("each word to its first letter", "{w: w[0] for w in words}"),
        ]
    )
    name = r.choice(["word_map", "build_dict", "to_mapping"])
    return spec(
        name,
        "words",
        f"takes a list of non-empty words and returns a dict mapping {which}",
        f"return {expr}",
        [(r.sample(WORDS, 3),), ([],), (["a", "bb"],)],
    )

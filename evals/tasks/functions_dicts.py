"""``functions`` templates over mappings: the ``dicts`` family."""

from __future__ import annotations

from evals.tasks.functions_spec import ints, spec, template


@template("dicts", 1)
def invert(r):
    name = r.choice(["invert", "swap_keys_values", "reverse_mapping"])
    return spec(
        name,
        "d",
        "returns a new dict that maps each value of the dict d to its key (the values are distinct)",
        "return {v: k for k, v in d.items()}",
        [({"a": 1, "b": 2},), ({},), ({1: "x"},)],
    )


@template("dicts", 2)
def word_counts(r):
    lower = r.choice([True, False])
    name = r.choice(["word_counts", "count_words", "word_frequencies"])
    src = (
        "counts = {}\nfor w in text.split():\n    "
        + ("w = w.lower()\n    " if lower else "")
        + "counts[w] = counts.get(w, 0) + 1\nreturn counts"
    )
    return spec(
        name,
        "text",
        "returns a dict mapping each word of text (words are separated by whitespace"
        + (", compared in lower case" if lower else "")
        + ") to how many times it occurs",
        src,
        [("the cat and The dog and the end",), ("",), ("a a a",)],
    )


@template("dicts", 3)
def group_by(r):
    key, expr = r.choice([("first letter", "w[0]"), ("length", "len(w)"), ("last letter", "w[-1]")])
    name = r.choice(["group_by_" + key.replace(" ", "_"), "group_words"])
    src = f"groups = {{}}\nfor w in words:\n    groups.setdefault({expr}, []).append(w)\nreturn groups"
    return spec(
        name,
        "words",
        f"groups the non-empty strings of the list words by their {key}: returns a dict mapping "
        f"each {key} to the list of words that have it, in their original order",
        src,
        [(["apple", "avocado", "banana", "cherry", "bean"],), ([],), (["a", "bb", "c", "dd", "eee"],)],
    )


@template("dicts", 2)
def merge_counts(r):
    op, word = r.choice([("+", "added"), ("max", "the larger kept")])
    name = r.choice(["merge_counts", "combine", "merge_dicts"])
    expr = "out[k] + v" if op == "+" else "max(out[k], v)"
    src = f"out = dict(a)\nfor k, v in b.items():\n    out[k] = {expr} if k in out else v\nreturn out"
    return spec(
        name,
        "a, b",
        f"merges the dicts a and b (numbers as values) into a new dict; for a key in both, the values are {word}",
        src,
        [({"x": 1, "y": 2}, {"y": 5, "z": 3}), ({}, {"a": 1}), ({"a": 4}, {"a": 2})],
    )


@template("dicts", 1)
def key_of_extreme(r):
    which, fn = r.choice([("largest", "max"), ("smallest", "min")])
    name = r.choice([f"key_with_{fn}_value", f"{fn}_key", f"{which}_entry"])
    return spec(
        name,
        "d",
        f"returns the key of the non-empty dict d whose value is the {which} (the first such key on a tie)",
        f"return {fn}(d, key=d.get)",
        [({"a": 3, "b": 7, "c": 7},), ({"x": -1},), ({"p": 2, "q": 1},)],
    )


@template("dicts", 1)
def filter_dict(r):
    k = r.choice([0, 10, 50])
    word, op = r.choice([("greater than", ">"), ("at most", "<=")])
    name = r.choice(["filter_dict", "keep_entries", "select_items"])
    return spec(
        name,
        "d",
        f"returns a new dict with only the entries of d whose value is {word} {k}",
        f"return {{key: v for key, v in d.items() if v {op} {k}}}",
        [({"a": k - 1, "b": k, "c": k + 1},), ({},), ({"x": k + 100, "y": k - 100},)],
    )


@template("dicts", 2)
def keys_by_value(r):
    order = r.choice(["largest first", "smallest first"])
    name = r.choice(["ranked_keys", "sort_keys_by_value"])
    rev = "True" if order == "largest first" else "False"
    return spec(
        name,
        "d",
        f"returns the keys of the dict d as a list sorted by their values, {order} (keys with equal "
        "values keep the dict's order)",
        f"return sorted(d, key=d.get, reverse={rev})",
        [({"a": 2, "b": 9, "c": 5},), ({},), ({"x": 1, "y": 1, "z": 0},)],
    )


@template("dicts", 3)
def nested_get(r):
    sep = r.choice([".", "/", "->"])
    name = r.choice(["get_path", "deep_get", "lookup"])
    src = f"""
        cur = data
        for key in path.split({sep!r}):
            if not isinstance(cur, dict) or key not in cur:
                return default
            cur = cur[key]
        return cur
    """
    d = {"a": {"b": {"c": 1}, "x": 2}, "k": 0}
    p = lambda *ks: sep.join(ks)  # noqa: E731
    return spec(
        name,
        "data, path, default",
        f"looks up a value in nested dicts: path names the keys separated by {sep!r} "
        f"(so {p('a', 'b')!r} means data['a']['b']); returns default when a key is missing",
        src,
        [(d, p("a", "b", "c"), None), (d, p("a", "x"), -1), (d, p("a", "q"), "none"), (d, "k", 5), (d, p("k", "z"), 0)],
    )


@template("dicts", 2)
def count_by_parity(r):
    kind = r.choice(["sign", "parity"])
    name = r.choice([f"count_by_{kind}", f"{kind}_counts", f"tally_{kind}"])
    if kind == "parity":
        src = (
            "out = {'even': 0, 'odd': 0}\nfor x in numbers:\n    out['even' if x % 2 == 0 else 'odd'] += 1\nreturn out"
        )
        what = "returns a dict {'even': e, 'odd': o} counting the even and odd numbers of the list"
    else:
        src = (
            "out = {'negative': 0, 'zero': 0, 'positive': 0}\nfor x in numbers:\n"
            "    out['negative' if x < 0 else 'zero' if x == 0 else 'positive'] += 1\nreturn out"
        )
        what = "returns a dict {'negative': n, 'zero': z, 'positive': p} counting the numbers of the list of each sign"
    return spec(name, "numbers", what, src, [(ints(r, 7),), ([],), ([0, 0, 1],)])

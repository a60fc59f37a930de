"""``functions`` templates of the ``lists`` family: selecting, counting, reordering and aggregating list items."""

from __future__ import annotations

from evals.tasks.functions_spec import ints, spec, template


@template("lists", 1)
def sum_selected(r):
    what, cond = r.choice(
        [
            ("even", "x % 2 == 0"),
            ("odd", "x % 2 != 0"),
            ("positive", "x > 0"),
            ("negative", "x < 0"),
            ("multiple-of-3", "x % 3 == 0"),
        ]
    )
    name = f"sum_{what.replace('-', '_')}"
    cases = [(ints(r, 6),), ([],), (ints(r, 3),), ([1, 2, 3, 4, 5, 6],)]
    return spec(
        name,
        "numbers",
        f"returns the sum of the {what.replace('-', ' ')} numbers in the list numbers",
        f"return sum(x for x in numbers if {cond})",
        cases,
    )


@template("lists", 1)
def filter_threshold(r):
    k = r.choice([0, 5, 10])
    word, op = r.choice([("greater than", ">"), ("less than", "<"), ("at least", ">=")])
    name = r.choice(["filter_values", "keep_values", "select"])
    return spec(
        name,
        "numbers",
        f"returns a new list with the numbers of the list that are {word} {k}, in order",
        f"return [x for x in numbers if x {op} {k}]",
        [(ints(r, 7),), ([],), ([k, k + 1, k - 1],)],
    )


@template("lists", 1)
def count_value(r):
    name = r.choice(["count_occurrences", "count_value", "how_many"])
    xs = ints(r, 8, 0, 3)
    return spec(
        name,
        "items, value",
        "returns how many elements of the list items are equal to value",
        "return sum(1 for x in items if x == value)",
        [(xs, xs[0]), ([], 1), (["a", "b", "a"], "a"), (xs, 9)],
    )


@template("lists", 2)
def dedupe(r):
    keep = r.choice(["first", "last"])
    name = r.choice(["remove_duplicates", "dedupe", "unique"])
    src = "seen = set()\nout = []\nfor x in items:\n    if x not in seen:\n        seen.add(x)\n        out.append(x)\nreturn out"
    if keep == "last":
        src = (
            "seen = set()\nout = []\nfor x in reversed(items):\n    if x not in seen:\n        seen.add(x)\n"
            "        out.append(x)\nreturn out[::-1]"
        )
    return spec(
        name,
        "items",
        f"returns the elements of the list items without duplicates, keeping the {keep} "
        "occurrence of each, in their original order",
        src,
        [([3, 1, 3, 2, 1],), ([],), (["a", "b", "a"],), (ints(r, 8, 0, 4),)],
    )


@template("lists", 2)
def second_extreme(r):
    which = r.choice(["largest", "smallest"])
    name = r.choice([f"second_{which}", f"runner_up_{which}", f"next_to_{which}"])
    rev = "True" if which == "largest" else "False"
    return spec(
        name,
        "numbers",
        f"returns the second {which} distinct value in the list numbers, or None when there are "
        "fewer than two distinct values",
        f"values = sorted(set(numbers), reverse={rev})\nreturn values[1] if len(values) > 1 else None",
        [([4, 1, 4, 3],), ([5],), (ints(r, 6),), ([2, 2],)],
    )


@template("lists", 2)
def running_total(r):
    op, word = r.choice([("+", "sum"), ("*", "product"), ("max", "maximum")])
    name = r.choice(["running_" + word, "cumulative_" + word])
    step = "acc = max(acc, x)" if op == "max" else f"acc = acc {op} x"
    src = (
        f"out = []\nfor i, x in enumerate(numbers):\n    if i == 0:\n        acc = x\n    else:\n        {step}\n"
        "    out.append(acc)\nreturn out"
    )
    return spec(
        name,
        "numbers",
        f"returns a list whose i-th element is the {word} of the first i + 1 numbers of the list",
        src,
        [([1, 2, 3, 4],), ([],), (ints(r, 5, -3, 6),), ([5],)],
    )


@template("lists", 2)
def chunks(r):
    name = r.choice(["chunk", "split_into_chunks", "batches"])
    return spec(
        name,
        "items, size",
        "splits the list items into consecutive lists of length size (the last one may be "
        "shorter) and returns the list of them",
        "return [items[i:i + size] for i in range(0, len(items), size)]",
        [([1, 2, 3, 4, 5], 2), ([], 3), (list("abcdef"), 3), ([1], 4)],
    )


@template("lists", 1)
def flatten(r):
    name = r.choice(["flatten", "flatten_once", "concat_lists"])
    return spec(
        name,
        "lists",
        "takes a list of lists and returns one list with all their elements, in order",
        "return [x for sub in lists for x in sub]",
        [([[1, 2], [3], []],), ([],), ([["a"], ["b", "c"]],)],
    )


@template("lists", 2)
def rotate(r):
    side = r.choice(["left", "right"])
    name = r.choice([f"rotate_{side}", f"shift_{side}", f"rotated_{side}"])
    src = "if not items:\n    return []\nk %= len(items)\n"
    src += "return items[k:] + items[:k]" if side == "left" else "return items[-k:] + items[:-k] if k else list(items)"
    return spec(
        name,
        "items, k",
        f"returns the list items rotated k positions to the {side} (k may exceed the length)",
        src,
        [([1, 2, 3, 4, 5], 2), ([1, 2, 3], 0), ([], 3), (["a", "b", "c"], 4)],
    )


@template("lists", 2)
def neighbour_diffs(r):
    word, expr = r.choice([("differences", "b - a"), ("sums", "a + b"), ("larger values", "max(a, b)")])
    name = r.choice(["pairwise_" + word.split()[-1], "adjacent_" + word.split()[-1]])
    return spec(
        name,
        "numbers",
        f"returns the list of {word} of each pair of neighbouring numbers (for [a, b, c]: the "
        f"values for (a, b) and (b, c)), where the value for (a, b) is {expr}",
        f"return [{expr} for a, b in zip(numbers, numbers[1:])]",
        [([1, 4, 9, 16],), ([3],), (ints(r, 5),)],
    )


@template("lists", 1)
def index_of_extreme(r):
    which, fn = r.choice([("largest", "max"), ("smallest", "min")])
    name = r.choice([f"index_of_{which}", f"position_of_{which}", f"argm{fn[1:]}"])
    return spec(
        name,
        "numbers",
        f"returns the index of the {which} number in the non-empty list (the first one on a tie)",
        f"return numbers.index({fn}(numbers))",
        [([3, 9, 2, 9],), ([5],), (ints(r, 6),)],
    )


@template("lists", 3)
def merge_sorted(r):
    order = r.choice(["ascending", "descending"])
    cmp = "<=" if order == "ascending" else ">="
    name = r.choice(["merge_sorted", "merge_lists"])
    src = f"""
        out, i, j = [], 0, 0
        while i < len(a) and j < len(b):
            if a[i] {cmp} b[j]:
                out.append(a[i])
                i += 1
            else:
                out.append(b[j])
                j += 1
        return out + a[i:] + b[j:]
    """
    s = lambda xs: sorted(xs, reverse=order == "descending")  # noqa: E731
    return spec(
        name,
        "a, b",
        f"merges two lists that are each sorted in {order} order into one {order} list",
        src,
        [(s([1, 4, 9]), s([2, 3, 10])), (s([]), s([1])), (s(ints(r, 4)), s(ints(r, 3)))],
    )


@template("lists", 3)
def interleave(r):
    name = r.choice(["interleave", "zip_merge", "alternate"])
    src = """
        out = []
        for i in range(max(len(a), len(b))):
            if i < len(a):
                out.append(a[i])
            if i < len(b):
                out.append(b[i])
        return out
    """
    return spec(
        name,
        "a, b",
        "returns the elements of the lists a and b alternately (a[0], b[0], a[1], b[1], ...); "
        "when one list is longer its remaining elements come at the end",
        src,
        [([1, 2, 3], ["x", "y"]), ([], [1]), ([1], [2, 3, 4])],
    )


@template("lists", 3)
def moving_average(r):
    k = r.choice([2, 3])
    name = r.choice(["moving_average", "rolling_mean", "smooth"])
    src = f"return [round(sum(numbers[i:i + {k}]) / {k}, 2) for i in range(len(numbers) - {k - 1})]"
    return spec(
        name,
        "numbers",
        f"returns the averages of every {k} consecutive numbers of the list (one per window, "
        f"each rounded to 2 decimals; an empty list when there are fewer than {k} numbers)",
        src,
        [([1, 2, 3, 4],), ([5],), ([1, 1, 2, 3, 5, 8],)],
    )


@template("lists", 1)
def product(r):
    skip = r.choice(["", "zero"])
    name = r.choice(["product", "multiply_all"])
    src = "result = 1\nfor x in numbers:\n" + ("    if x != 0:\n        result *= x" if skip else "    result *= x")
    return spec(
        name,
        "numbers",
        "returns the product of the numbers in the list"
        + (", ignoring zeros" if skip else "")
        + " (1 for an empty list)",
        src + "\nreturn result",
        [([2, 3, 4],), ([],), ([0, 5, 2],), (ints(r, 4, -3, 5),)],
    )


@template("lists", 2)
def check_order(r):
    word, op = r.choice([("non-decreasing", "<="), ("strictly increasing", "<"), ("non-increasing", ">=")])
    name = r.choice(["is_sorted", "in_order", "check_sorted"])
    return spec(
        name,
        "numbers",
        f"returns True if the list numbers is in {word} order, else False (an empty list is)",
        f"return all(a {op} b for a, b in zip(numbers, numbers[1:]))",
        [([1, 2, 2, 3],), ([1, 2, 3],), ([3, 2, 2, 1],), ([],), ([2, 1, 3],)],
    )


@template("lists", 3)
def longest_run(r):
    word, cond = r.choice(
        [("strictly increasing", "numbers[i] > numbers[i - 1]"), ("equal", "numbers[i] == numbers[i - 1]")]
    )
    name = r.choice(["longest_run", "longest_streak"])
    src = f"""
        best = cur = 1 if numbers else 0
        for i in range(1, len(numbers)):
            cur = cur + 1 if {cond} else 1
            best = max(best, cur)
        return best
    """
    return spec(
        name,
        "numbers",
        f"returns the length of the longest stretch of consecutive {word} numbers in the list "
        "(0 for an empty list, 1 when no neighbours qualify)",
        src,
        [([1, 2, 3, 1, 2],), ([],), ([5, 5, 5, 2],), ([3, 2, 1],), (ints(r, 8, 0, 4),)],
    )

"""``functions`` templates over values: the ``lists`` and ``numbers`` families."""

from __future__ import annotations

from evals.tasks.functions_spec import ints, spec, template

# ---- lists -----------------------------------------------------------------------------------


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
    k, word, op = r.choice([0, 5, 10]), *r.choice([("greater than", ">"), ("less than", "<"), ("at least", ">=")])
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


# ---- numbers ---------------------------------------------------------------------------------


@template("numbers", 2)
def is_prime(r):
    name = r.choice(["is_prime", "check_prime", "prime"])
    src = "if n < 2:\n    return False\ni = 2\nwhile i * i <= n:\n    if n % i == 0:\n        return False\n    i += 1\nreturn True"
    return spec(
        name,
        "n",
        "returns True if the integer n is a prime number, else False",
        src,
        [(2,), (1,), (0,), (17,), (21,), (97,), (-7,), (49,)],
    )


@template("numbers", 1)
def series_sum(r):
    word, expr = r.choice(
        [
            ("the integers from 1 to n", "i"),
            ("the squares of the integers from 1 to n", "i * i"),
            ("the cubes of the integers from 1 to n", "i ** 3"),
        ]
    )
    name = r.choice(["sum_to", "series_sum", "total_up_to"])
    return spec(
        name,
        "n",
        f"returns the sum of {word} (0 when n is less than 1)",
        f"return sum({expr} for i in range(1, n + 1))",
        [(1,), (4,), (0,), (10,)],
    )


@template("numbers", 2)
def fibonacci(r):
    a, b = r.choice([(0, 1), (2, 1), (1, 1)])
    name = {(0, 1): "fib", (2, 1): "lucas", (1, 1): "fibonacci"}[(a, b)]
    src = f"a, b = {a}, {b}\nfor _ in range(n):\n    a, b = b, a + b\nreturn a"
    return spec(
        name,
        "n",
        f"returns the n-th term of the sequence that starts {a}, {b} and where every later term is "
        "the sum of the two before it (n = 0 gives the first term)",
        src,
        [(0,), (1,), (2,), (7,), (15,)],
    )


@template("numbers", 1)
def digit_stat(r):
    word, expr = r.choice(
        [
            ("the sum of the digits", "sum(int(d) for d in str(abs(n)))"),
            ("the number of digits", "len(str(abs(n)))"),
            ("the largest digit", "max(int(d) for d in str(abs(n)))"),
        ]
    )
    name = {"the sum of the digits": "digit_sum", "the number of digits": "count_digits"}.get(word, "max_digit")
    return spec(
        name,
        "n",
        f"returns {word} of the integer n (ignoring its sign)",
        f"return {expr}",
        [(1234,), (0,), (-907,), (5,)],
    )


@template("numbers", 2)
def gcd_lcm(r):
    which = r.choice(["gcd", "lcm"])
    src = (
        "a, b = abs(a), abs(b)\nwhile b:\n    a, b = b, a % b\nreturn a"
        if which == "gcd"
        else "x, y = abs(a), abs(b)\nwhile y:\n    x, y = y, x % y\nreturn abs(a * b) // x if x else 0"
    )
    word = "greatest common divisor" if which == "gcd" else "least common multiple"
    name = r.choice([which, f"{which}_of", "greatest_divisor" if which == "gcd" else "smallest_multiple"])
    return spec(
        name, "a, b", f"returns the {word} of the positive integers a and b", src, [(12, 18), (7, 5), (21, 6), (10, 10)]
    )


@template("numbers", 1)
def clamp(r):
    lo, hi = r.choice([(0, 100), (0, 255), (-1, 1), (1, 10)])
    name = r.choice(["clamp", "limit", "bound"])
    return spec(
        name,
        "x",
        f"returns x limited to the range [{lo}, {hi}]: {lo} when x is below it, {hi} when above it",
        f"return max({lo}, min({hi}, x))",
        [(lo - 5,), (hi + 3,), ((lo + hi) // 2,), (lo,)],
    )


@template("numbers", 1)
def convert_units(r):
    what, expr, cases = r.choice(
        [
            ("a temperature in Celsius to Fahrenheit", "c * 9 / 5 + 32", [(0,), (100,), (-40,), (37,)]),
            ("a temperature in Fahrenheit to Celsius", "(c - 32) * 5 / 9", [(32,), (212,), (-40,), (100,)]),
            ("kilometres to miles (1 mile = 1.609344 km)", "c / 1.609344", [(0,), (10,), (42.195,)]),
            ("kilograms to pounds (1 kg = 2.20462 lb)", "c * 2.20462", [(0,), (1,), (70,)]),
        ]
    )
    name = r.choice(["convert", "to_other_unit"])
    return spec(
        name, "c", f"converts {what} and returns the result rounded to 1 decimal", f"return round({expr}, 1)", cases
    )


@template("numbers", 2)
def is_leap(r):
    name = r.choice(["is_leap_year", "leap_year", "is_leap"])
    return spec(
        name,
        "year",
        "returns True if year is a leap year in the Gregorian calendar (divisible by 4, except "
        "century years that are not divisible by 400), else False",
        "return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)",
        [(2024,), (1900,), (2000,), (2023,), (2100,)],
    )


@template("numbers", 2)
def count_divisors(r):
    which, cond = r.choice(
        [("divisors", ""), ("even divisors", " and d % 2 == 0"), ("odd divisors", " and d % 2 == 1")]
    )
    name = "count_" + which.replace(" ", "_")
    return spec(
        name,
        "n",
        f"returns how many {which} the positive integer n has (1 and n included)",
        f"return sum(1 for d in range(1, n + 1) if n % d == 0{cond})",
        [(1,), (12,), (7,), (36,)],
    )


@template("numbers", 3)
def collatz(r):
    name = r.choice(["collatz_steps", "steps_to_one", "collatz_length", "count_collatz_steps"])
    src = "steps = 0\nwhile n != 1:\n    n = n // 2 if n % 2 == 0 else 3 * n + 1\n    steps += 1\nreturn steps"
    return spec(
        name,
        "n",
        "returns how many steps the Collatz rule needs to bring the positive integer n to 1 "
        "(halve n when even, else replace it by 3 * n + 1)",
        src,
        [(1,), (6,), (27,), (8,)],
    )


@template("numbers", 2)
def reverse_number(r):
    name = r.choice(["reverse_number", "reverse_digits", "flip_digits"])
    return spec(
        name,
        "n",
        "returns the integer whose digits are those of n in reverse order, keeping n's sign (leading zeros disappear)",
        "sign = -1 if n < 0 else 1\nreturn sign * int(str(abs(n))[::-1])",
        [(123,), (-450,), (0,), (7,)],
    )


@template("numbers", 1)
def binary_repr(r):
    what, expr = r.choice(
        [
            ("its binary representation as a string without the '0b' prefix", "bin(n)[2:]"),
            ("how many 1 bits its binary representation has", "bin(n).count('1')"),
            ("its hexadecimal representation in lower case without the '0x' prefix", "hex(n)[2:]"),
        ]
    )
    name = {"bin": "to_binary", "hex": "to_hex"}.get(expr[:3], "count_ones")
    return spec(
        name, "n", f"takes a non-negative integer n and returns {what}", f"return {expr}", [(0,), (5,), (255,), (1024,)]
    )


@template("numbers", 3)
def fizzbuzz(r):
    a, b = r.choice([(3, 5), (2, 7), (4, 6)])
    wa, wb = r.choice([("Fizz", "Buzz"), ("Foo", "Bar"), ("Ping", "Pong")])
    name = r.choice(["fizzbuzz", "word_game"])
    src = f"""
        out = []
        for i in range(1, n + 1):
            word = ('{wa}' if i % {a} == 0 else '') + ('{wb}' if i % {b} == 0 else '')
            out.append(word or str(i))
        return out
    """
    return spec(
        name,
        "n",
        f"returns a list of strings for the numbers 1 to n: '{wa}' for multiples of {a}, '{wb}' for "
        f"multiples of {b}, '{wa}{wb}' for multiples of both, else the number itself as a string",
        src,
        [(1,), (a * b + 1,), (0,)],
    )


@template("numbers", 2)
def special_number(r):
    what, src = r.choice(
        [
            (
                "a perfect square",
                "if n < 0:\n    return False\nr = int(n ** 0.5)\nwhile r * r > n:\n    r -= 1\n"
                "while (r + 1) * (r + 1) <= n:\n    r += 1\nreturn r * r == n",
            ),
            ("a power of two", "return n > 0 and n & (n - 1) == 0"),
            ("a power of three", "if n < 1:\n    return False\nwhile n % 3 == 0:\n    n //= 3\nreturn n == 1"),
        ]
    )
    name = "is_" + what.split(" ", 1)[1].replace(" ", "_")
    return spec(
        name,
        "n",
        f"returns True if the integer n is {what}, else False",
        src,
        [(1,), (16,), (27,), (18,), (0,), (-4,), (64,), (81,)],
    )


@template("numbers", 2)
def round_to_multiple(r):
    k = r.choice([5, 10, 25])
    way, expr = r.choice([("down", f"x // {k} * {k}"), ("up", f"-(-x // {k}) * {k}")])
    name = r.choice([f"round_{way}", f"round_{way}_to_{k}"])
    return spec(
        name,
        "x",
        f"rounds the integer x {way} to a multiple of {k}",
        f"return {expr}",
        [(0,), (k + 1,), (k,), (3 * k - 1,), (-1,)],
    )

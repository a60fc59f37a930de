"""``functions`` templates of the ``numbers`` family: primes, divisors, digits, sequences, conversions and rounding."""

from __future__ import annotations

from evals.tasks.functions_spec import spec, template


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

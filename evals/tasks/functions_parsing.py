"""``functions`` templates of the ``parsing`` family: reading numbers, fields and pairs out of text."""

from __future__ import annotations

from evals.tasks.functions_spec import WORDS, spec, template


@template("parsing", 2)
def parse_pairs(r):
    pair, kv = r.choice([(";", "="), (",", "="), ("&", "="), (";", ":"), (",", ":")])
    name = r.choice(["parse_pairs", "parse_settings", "to_dict"])
    src = f"""
        out = {{}}
        for part in text.split({pair!r}):
            if part:
                key, value = part.split({kv!r}, 1)
                out[key] = int(value)
        return out
    """
    mk = lambda d: pair.join(f"{k}{kv}{v}" for k, v in d.items())  # noqa: E731
    cases = [(mk({"a": 1, "b": 22}),), (mk({"x": -3}),), ("",), (mk({w: i for i, w in enumerate(r.sample(WORDS, 3))}),)]
    return spec(
        name,
        "text",
        f"parses text like 'a{kv}1{pair}b{kv}2' into a dict mapping each key to its value "
        "as an int ({} for an empty string)",
        src,
        cases,
    )


@template("parsing", 2)
def sum_listed(r):
    sep = r.choice([",", ";", " ", "+"])
    name = r.choice(["sum_numbers", "total", "add_up"])
    mk = lambda xs: sep.join(str(x) for x in xs)  # noqa: E731
    return spec(
        name,
        "text",
        f"returns the sum of the integers in text, which are separated by {sep!r} (0 for an empty string)",
        f"return sum(int(p) for p in text.split({sep!r}) if p.strip())",
        [(mk([1, 2, 3]),), (mk([10]),), ("",), (mk([-4, 5, 6, 7]),)],
    )


@template("parsing", 1)
def only_digits(r):
    as_int = r.choice([False, True])
    name = r.choice(["extract_digits", "digits_only", "keep_digits"])
    what = (
        "returns the digits of s, in order, as a string"
        if not as_int
        else "returns the number formed by the digits of s, in order, as an int (0 when s has no digits)"
    )
    src = (
        "return ''.join(ch for ch in s if ch.isdigit())"
        if not as_int
        else "digits = ''.join(ch for ch in s if ch.isdigit())\nreturn int(digits) if digits else 0"
    )
    return spec(name, "s", what, src, [("a1b2c3",), ("phone: 555-0199",), ("none",), ("2024 is 42",)])


@template("parsing", 2)
def clock_to_units(r):
    fmt, unit, mult = r.choice([("'HH:MM'", "minutes", 60), ("'MM:SS'", "seconds", 60), ("'H:MM'", "minutes", 60)])
    name = r.choice([f"to_{unit}", f"{unit}_from_clock", f"parse_{unit}"])
    return spec(
        name,
        "text",
        f"converts a time written as {fmt} into a total number of {unit} (an int)",
        f"a, b = text.split(':')\nreturn int(a) * {mult} + int(b)",
        [("01:30",), ("00:00",), ("12:05",), ("3:07",), ("23:59",)],
    )


@template("parsing", 2)
def count_prefixed_lines(r):
    prefix = r.choice(["#", "//", "TODO", "- "])
    name = r.choice(["count_comment_lines", "count_marked_lines", "lines_starting_with"])
    text = lambda ls: "\n".join(ls)  # noqa: E731
    return spec(
        name,
        "text",
        f"returns how many lines of text start with {prefix!r} after leading spaces are removed",
        f"return sum(1 for line in text.splitlines() if line.lstrip().startswith({prefix!r}))",
        [(text([prefix + "a", "b", "  " + prefix + "c"]),), ("",), (text(["x", "y"]),), (prefix,)],
    )


@template("parsing", 2)
def split_fields(r):
    sep = r.choice([",", ";", "|", "\t"])
    name = r.choice(["split_fields", "parse_row", "fields"])
    return spec(
        name,
        "line",
        f"splits line on {sep!r} and returns the fields with surrounding spaces removed, leaving out empty fields",
        f"return [f.strip() for f in line.split({sep!r}) if f.strip()]",
        [(f"a{sep} b {sep}{sep}c",), ("",), (f" x {sep}y",), ("single",)],
    )


@template("parsing", 3)
def compare_versions(r):
    sep = r.choice([".", "-", "_"])
    name = r.choice(["compare_versions", "version_cmp", "cmp_versions"])
    src = f"""
        pa = [int(x) for x in a.split({sep!r})]
        pb = [int(x) for x in b.split({sep!r})]
        n = max(len(pa), len(pb))
        pa += [0] * (n - len(pa))
        pb += [0] * (n - len(pb))
        return (pa > pb) - (pa < pb)
    """
    v = lambda *xs: sep.join(str(x) for x in xs)  # noqa: E731
    return spec(
        name,
        "a, b",
        f"compares two version strings made of numbers separated by {sep!r} (like "
        f"{v(1, 10, 2)!r}) part by part as numbers, a missing part counting as 0, and returns -1 if a is "
        "older, 1 if a is newer, 0 if they are equal",
        src,
        [
            (v(1, 2, 10), v(1, 2, 9)),
            (v(1, 0), v(1, 0, 0)),
            (v(0, 9), v(1)),
            (v(2, 1), v(2, 1)),
            (
                v(
                    3,
                ),
                v(3, 0, 1),
            ),
        ],
    )


@template("parsing", 1)
def email_part(r):
    part, expr = r.choice(
        [
            ("domain (the part after the '@')", "email.split('@', 1)[1]"),
            ("user name (the part before the '@')", "email.split('@', 1)[0]"),
        ]
    )
    name = r.choice(["email_{}", "get_{}", "{}_of_email"]).format("domain" if part.startswith("domain") else "user")
    return spec(
        name,
        "email",
        f"returns the {part} of the email address email",
        f"return {expr}",
        [("ann@example.com",), ("bob.smith@mail.co.uk",), ("x@y",)],
    )


@template("parsing", 2)
def file_extension(r):
    lower = r.choice([False, True])
    name = r.choice(["file_extension", "get_extension", "ext"])
    src = "base = path.rsplit('/', 1)[-1]\nif '.' not in base.lstrip('.'):\n    return ''\n"
    src += "return base.rsplit('.', 1)[1]" + (".lower()" if lower else "")
    return spec(
        name,
        "path",
        "returns the extension of the file path without the dot (the text after the last '.' "
        "of the file name" + (", in lower case" if lower else "") + "), or '' when the name has none",
        src,
        [("report.final.PDF",), ("dir.v2/readme",), ("notes.txt",), ("archive.tar.gz",), (".bashrc",)],
    )


@template("parsing", 1)
def word_lengths(r):
    sep = r.choice([" ", ",", ";"])
    name = r.choice(["word_lengths", "lengths_of_words", "measure_words"])
    cases = [(sep.join(r.sample(WORDS, 3)),), ("a" + sep + "bb" + sep + "ccc",), ("one",)]
    return spec(
        name,
        "text",
        f"returns a list with the length of each word of text, in order (words are separated by {sep!r})",
        f"return [len(w) for w in text.split({sep!r})]",
        cases,
    )


@template("parsing", 3)
def parse_duration(r):
    units = r.choice([("h", "m"), ("m", "s")])
    big, small = units
    target = "minutes" if units == ("h", "m") else "seconds"
    name = r.choice(["parse_duration", f"duration_in_{target}"])
    src = f"""
        total = 0
        for part in text.split():
            if part.endswith({big!r}):
                total += int(part[:-1]) * 60
            elif part.endswith({small!r}):
                total += int(part[:-1])
        return total
    """
    return spec(
        name,
        "text",
        f"parses a duration like '2{big} 15{small}' (parts separated by spaces, either may be "
        f"missing) and returns the total number of {target}",
        src,
        [(f"2{big} 15{small}",), (f"45{small}",), (f"3{big}",), ("",), (f"10{small} 1{big}",)],
    )

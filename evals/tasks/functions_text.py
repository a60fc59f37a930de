"""``functions`` templates over text: the ``strings`` and ``parsing`` families."""

from __future__ import annotations

from evals.tasks.functions_spec import spec, template

WORDS = ["apple", "river", "stone", "cloud", "tiger", "lemon", "piano", "ocean", "maple", "robot", "sugar", "delta"]


def _sentences(r, n=4, sep=" "):
    return [sep.join(r.sample(WORDS, r.randint(2, 5))) for _ in range(n)]


# ---- strings ---------------------------------------------------------------------------------


@template("strings", 1)
def count_char_class(r):
    kind, test = r.choice(
        [
            ("vowels (a, e, i, o, u, either case)", "ch.lower() in 'aeiou'"),
            ("digits", "ch.isdigit()"),
            ("upper-case letters", "ch.isupper()"),
            ("spaces", "ch == ' '"),
        ]
    )
    name = r.choice(["count_{}", "num_{}", "how_many_{}"]).format(kind.split()[0].replace("-", "_").lower())
    cases = [("Hello World 42",), ("",), ("AEIOU xyz 7 7",), ("no Caps here 1",), ("  aa  BB 9",)]
    return spec(
        name, "s", f"returns how many {kind} the string s contains", f"return sum(1 for ch in s if {test})", cases
    )


@template("strings", 1)
def reverse_words(r):
    sep = r.choice([" ", ",", "-", "/"])
    name = r.choice(["reverse_words", "flip_words", "words_backwards"])
    cases = [(sep.join(r.sample(WORDS, k)),) for k in (1, 2, 3, 5)]
    return spec(
        name,
        "s",
        f"returns s with the order of its words reversed; words are separated by {sep!r}",
        f"return {sep!r}.join(reversed(s.split({sep!r})))",
        cases,
    )


@template("strings", 1)
def change_case(r):
    what, expr = r.choice(
        [
            ("every letter in upper case", "s.upper()"),
            ("every letter in lower case", "s.lower()"),
            ("the case of every letter swapped", "s.swapcase()"),
            ("the first letter of every word capitalized and the rest lower case", "s.title()"),
        ]
    )
    name = r.choice(["convert_case", "recase", "fix_case", "format_text"])
    return spec(
        name,
        "s",
        f"returns s with {what}",
        f"return {expr}",
        [("hello World",), ("ABC def",), ("",), ("mIxEd cAsE words",)],
    )


@template("strings", 2)
def is_palindrome(r):
    rule, prep = r.choice(
        [("", "s"), (", ignoring case", "s.lower()"), (", ignoring case and spaces", "s.lower().replace(' ', '')")]
    )
    name = r.choice(["is_palindrome", "reads_same_backwards", "palindrome"])
    cases = [("Level",), ("abba",), ("abc",), ("Never odd or even",), ("",), ("ab a",), ("racecar",)]
    return spec(
        name,
        "s",
        f"returns True if s reads the same forwards and backwards{rule}, else False",
        f"t = {prep}\nreturn t == t[::-1]",
        cases,
    )


@template("strings", 1)
def remove_char(r):
    ch = r.choice(["a", "e", " ", "-", "x"])
    name = r.choice(["remove_{}", "strip_all_{}", "drop_{}"]).format({" ": "spaces", "-": "dashes"}.get(ch, ch + "s"))
    cases = [("banana and apple",), ("x-ray - box",), ("",), ("eee e",), ("no match here",)]
    return spec(name, "s", f"returns s with every {ch!r} character removed", f"return s.replace({ch!r}, '')", cases)


@template("strings", 1)
def repeat_joined(r):
    sep = r.choice(["-", ", ", " ", "|"])
    name = r.choice(["repeat", "repeat_text", "echo"])
    return spec(
        name,
        "s, n",
        f"returns s repeated n times, with {sep!r} between the copies (an empty string when n is 0)",
        f"return {sep!r}.join([s] * n)",
        [("ab", 3), ("x", 1), ("hi", 0), ("", 2), ("go", 4)],
    )


@template("strings", 1)
def has_affix(r):
    affix = r.choice(["test_", "http", "#", "Mr. "])
    where, method = r.choice([("starts", "startswith"), ("ends", "endswith")])
    name = f"{where}_with_{''.join(c for c in affix.lower() if c.isalnum()) or 'hash'}"
    cases = [(affix + "x",), ("x" + affix,), (affix,), ("",), ("nothing",), (affix.upper() + "y",)]
    return spec(
        name, "s", f"returns True if s {where} with {affix!r}, else False", f"return s.{method}({affix!r})", cases
    )


@template("strings", 2)
def longest_word(r):
    which, cmp = r.choice([("longest", ">"), ("shortest", "<")])
    name = r.choice([f"{which}_word", f"find_{which}_word"])
    cases = [(s,) for s in _sentences(r, 4)] + [("aa bb cc",), ("one",)]
    src = f"""
        best = None
        for word in sentence.split():
            if best is None or len(word) {cmp} len(best):
                best = word
        return best if best is not None else ''
    """
    return spec(
        name,
        "sentence",
        f"returns the {which} word of the sentence (words are separated by spaces; the "
        f"first one on a tie; '' for an empty sentence)",
        src,
        cases + [("",)],
    )


@template("strings", 2)
def acronym(r):
    sep = r.choice([" ", "-", "_"])
    name = r.choice(["acronym", "initials", "abbreviate"])
    cases = [(sep.join(r.sample(WORDS, k)),) for k in (2, 3, 4)] + [("portable network graphics".replace(" ", sep),)]
    return spec(
        name,
        "phrase",
        f"returns the upper-case first letters of the words of phrase (words separated by {sep!r})",
        f"return ''.join(w[0].upper() for w in phrase.split({sep!r}) if w)",
        cases,
    )


@template("strings", 3)
def run_length(r):
    fmt, expr = r.choice(
        [("the character followed by the count", "ch + str(n)"), ("the count followed by the character", "str(n) + ch")]
    )
    name = r.choice(["compress", "run_length_encode", "rle"])
    src = f"""
        out = []
        i = 0
        while i < len(s):
            ch, n = s[i], 1
            while i + n < len(s) and s[i + n] == ch:
                n += 1
            out.append({expr})
            i += n
        return ''.join(out)
    """
    return spec(
        name,
        "s",
        f"run-length encodes s: each run of the same character becomes {fmt}, e.g. 'aaab' has runs 'aaa' and 'b'",
        src,
        [("aaabcc",), ("",), ("abc",), ("zzzzzz",), ("aabbaa",)],
    )


@template("strings", 3)
def caesar(r):
    k = r.choice([1, 3, 5, 13])
    name = r.choice(["caesar", "shift_letters", "rotate_letters"])
    src = f"""
        out = []
        for ch in s:
            if 'a' <= ch <= 'z':
                out.append(chr((ord(ch) - ord('a') + {k}) % 26 + ord('a')))
            else:
                out.append(ch)
        return ''.join(out)
    """
    return spec(
        name,
        "s",
        f"shifts every lower-case letter of s {k} places forward in the alphabet, wrapping "
        "from 'z' to 'a'; other characters stay as they are",
        src,
        [("abc",), ("xyz",), ("hello, World!",), ("",)],
    )


@template("strings", 2)
def mask_tail(r):
    k, ch = r.choice([2, 3, 4]), r.choice(["*", "#"])
    name = r.choice(["mask", "hide_digits", "redact"])
    return spec(
        name,
        "s",
        f"returns s with every character except the last {k} replaced by {ch!r} "
        f"(strings of length {k} or less are returned unchanged)",
        f"return {ch!r} * max(len(s) - {k}, 0) + s[-{k}:] if len(s) > {k} else s",
        [("1234567890",), ("ab",), ("",), ("secret",), ("abcd",)],
    )


@template("strings", 2)
def convert_identifier(r):
    src_style, dst, code = r.choice(
        [
            (
                "snake_case",
                "camelCase",
                "parts = s.split('_')\nreturn parts[0] + ''.join(p.capitalize() for p in parts[1:])",
            ),
            ("snake_case", "PascalCase", "return ''.join(p.capitalize() for p in s.split('_'))"),
            ("kebab-case", "snake_case", "return s.replace('-', '_')"),
            ("snake_case", "kebab-case", "return s.replace('_', '-')"),
        ]
    )
    sep = "-" if src_style.startswith("kebab") else "_"
    name = {"camelCase": "to_camel", "PascalCase": "to_pascal", "snake_case": "to_snake", "kebab-case": "to_kebab"}[dst]
    cases = [(sep.join(r.sample(WORDS, k)),) for k in (1, 2, 3)] + [(sep.join(["get", "user", "id"]),)]
    return spec(name, "s", f"converts the {src_style} identifier s to {dst}", code, cases)


@template("strings", 1)
def count_substring(r):
    sub = r.choice(["ab", "the", "--", "na"])
    name = r.choice(["count_{}", "occurrences_of_{}"]).format({"--": "dashes"}.get(sub, sub))
    return spec(
        name,
        "s",
        f"returns how many non-overlapping times {sub!r} occurs in s",
        f"return s.count({sub!r})",
        [("abcabab",), ("the other theme",), ("a----b",), ("banana",), ("",)],
    )


@template("strings", 3)
def first_repeated(r):
    which = r.choice(["character", "word"])
    split = "s" if which == "character" else "s.split()"
    name = r.choice([f"first_repeated_{which}", f"first_duplicate_{which}", f"repeated_{which}"])
    src = f"""
        seen = set()
        for item in {split}:
            if item in seen:
                return item
            seen.add(item)
        return ''
    """
    cases = (
        [("abca",), ("abc",), ("",), ("xyzzy",)]
        if which == "character"
        else [("a b c a",), ("one two three",), ("",), ("x y y x",)]
    )
    return spec(
        name,
        "s",
        f"returns the first {which} of s that appears a second time (scanning left to right), "
        f"or '' if no {which} repeats" + ("; words are separated by spaces" if which == "word" else ""),
        src,
        cases,
    )


@template("strings", 2)
def is_anagram(r):
    rule, prep = r.choice(
        [
            ("", "sorted({})"),
            (" ignoring case", "sorted({}.lower())"),
            (" ignoring case and spaces", "sorted({}.lower().replace(' ', ''))"),
        ]
    )
    name = r.choice(["is_anagram", "are_anagrams", "same_letters"])
    return spec(
        name,
        "a, b",
        f"returns True if a and b are anagrams of each other{rule}, else False",
        f"return {prep.format('a')} == {prep.format('b')}",
        [("listen", "silent"), ("Listen", "Silent"), ("a gentleman", "elegant man"), ("abc", "abd"), ("", "")],
    )


@template("strings", 2)
def truncate(r):
    tail = r.choice(["...", "~", " [more]"])
    name = r.choice(["truncate", "shorten", "clip_text"])
    return spec(
        name,
        "s, n",
        f"returns s unchanged if it has at most n characters, else its first n characters followed by {tail!r}",
        f"return s if len(s) <= n else s[:n] + {tail!r}",
        [("hello world", 5), ("hi", 5), ("", 0), ("abcdef", 6), ("abcdef", 0)],
    )


@template("strings", 1)
def pad_left(r):
    ch = r.choice(["0", " ", "*", "."])
    name = r.choice(["pad_left", "left_pad", "fill_left"])
    return spec(
        name,
        "s, width",
        f"returns s padded on the left with {ch!r} characters to the given width "
        "(unchanged when it is already that long or longer)",
        f"return s.rjust(width, {ch!r})",
        [("42", 5), ("abc", 2), ("", 3), ("x", 1), ("7", 4)],
    )


# ---- parsing ---------------------------------------------------------------------------------


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

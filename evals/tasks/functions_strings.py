"""``functions`` templates of the ``strings`` family: counting, casing, reordering, comparing and encoding text."""

from __future__ import annotations

from evals.tasks.functions_spec import WORDS, spec, template


def _sentences(r, n=4, sep=" "):
    return [sep.join(r.sample(WORDS, r.randint(2, 5))) for _ in range(n)]


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

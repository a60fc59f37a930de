"""Code-skeleton distance between two functions: how far one task's reference is from another's once
names and constants are set aside, the measure that says a held-out request is not a trained one
with other words (``evals/functions_splits.toml``, tests/unit/test_functions_splits.py).

A reference's *skeleton* is its Python token stream (``tokenize``) with every identifier that is not a
keyword or a builtin replaced by ``ID``, every number by ``NUM`` and every string by ``STR``; operators,
keywords and builtins (``len``, ``sorted``, ``sum`` ...) stay. The distance is the Levenshtein
distance between two skeletons, in tokens (RapidFuzz). Two variants of one template, which differ
only in names and constants, are typically 0-3 tokens apart; ``x + y`` and ``x * y`` are 1 apart.

Invariant: a pure function of the two sources (no state, no randomness).
"""

from __future__ import annotations

import builtins
import io
import keyword
import tokenize
from functools import lru_cache

from rapidfuzz.distance import Levenshtein

_KEEP = frozenset(keyword.kwlist) | frozenset(dir(builtins))
_SKIP = {tokenize.NEWLINE, tokenize.NL, tokenize.COMMENT, tokenize.ENCODING, tokenize.ENDMARKER}
# Python 3.12 splits an f-string into start, middle and end tokens; 3.11 has one STRING token
_STRING = {tokenize.STRING, getattr(tokenize, "FSTRING_START", tokenize.STRING)}
_SKIP |= {getattr(tokenize, n) for n in ("FSTRING_MIDDLE", "FSTRING_END") if hasattr(tokenize, n)}


@lru_cache(maxsize=4096)
def code_skeleton(source: str) -> tuple[str, ...]:
    """The skeleton of ``source`` (see the module docstring): a tuple of token strings.

    Raises:
        tokenize.TokenError: ``source`` does not tokenize (an unclosed bracket or string).
    """
    out: list[str] = []
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type in _SKIP:
            continue
        if tok.type == tokenize.NAME:
            out.append(tok.string if tok.string in _KEEP else "ID")
        elif tok.type == tokenize.NUMBER:
            out.append("NUM")
        elif tok.type in _STRING:
            out.append("STR")
        elif tok.type == tokenize.INDENT:
            out.append("INDENT")
        elif tok.type == tokenize.DEDENT:
            out.append("DEDENT")
        else:
            out.append(tok.string)
    return tuple(out)


def skeleton_distance(a: str, b: str) -> int:
    """Levenshtein distance (tokens) between the skeletons of sources ``a`` and ``b``."""
    return int(Levenshtein.distance(code_skeleton(a), code_skeleton(b)))

""" "Apply" for replies without tool calls: code the agent wrote in chat becomes an edit.

Editors offer an Apply button on code in a chat answer; the simulated developer presses it. The
harness does the same when a reply has no ``<tool_call>`` but carries Python code that defines the
task's entry point: the code replaces the task's main file as an ``edit.proposed`` (it is not a
tool call, so it is neither counted as one nor as an invalid one).

Invariant: only syntactically valid Python is applied — the longest prefix of the code block (or
of the bare reply) that parses, and only if it defines the entry point (any function when the
task names none).
"""

from __future__ import annotations

import ast
import re

_FENCE = re.compile(r"```(?:python|py)?[ \t]*\n(.*?)(?:```|\Z)", re.DOTALL)


def _longest_parsing_prefix(code: str, max_drop: int = 60) -> str | None:
    lines = code.rstrip().splitlines()
    for cut in range(len(lines), max(len(lines) - max_drop, 0), -1):
        candidate = "\n".join(lines[:cut]).rstrip() + "\n"
        try:
            ast.parse(candidate)
        except (SyntaxError, ValueError):
            continue
        return candidate
    return None


def _defines(code: str, entry_point: str | None) -> bool:
    tree = ast.parse(code)
    names = {n.name for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))}
    return entry_point in names if entry_point else bool(names)


def extract_code(reply: str, entry_point: str | None) -> str | None:
    """The Python code to apply from a chat reply, or None.

    Tries each fenced block (first first), then the reply itself; returns the longest parsing
    prefix that defines ``entry_point``.
    """
    candidates = [m.group(1) for m in _FENCE.finditer(reply)] + [reply]
    for raw in candidates:
        if not raw.strip():
            continue
        code = _longest_parsing_prefix(raw)
        if code and _defines(code, entry_point):
            return code
    return None


def apply_target(files: dict[str, str]) -> str | None:
    """The file an applied code block replaces: ``solution.py``, else the only Python file."""
    if "solution.py" in files:
        return "solution.py"
    py = [p for p in files if p.endswith(".py")]
    return py[0] if len(py) == 1 else None

"""The agent's tool-call format: parsing model text into validated calls.

Format (Hermes/Qwen style, inside SmolLM2's ChatML assistant turn)::

    <tool_call>{"name": "edit_file", "arguments": {"path": "solution.py", "content": "..."}}</tool_call>

A reply may hold several calls; they run in order. Text outside the tags is the agent's message
to the developer. A reply with no ``<tool_call>`` tag ends the agent's turn (it answered or asked).
Invariant: every ``<tool_call>`` opening in a reply yields exactly one :class:`ParsedCall` —
malformed JSON, an unknown tool or bad arguments give ``valid=False`` with an ``error`` the
harness sends back to the model (and counts); nothing is silently dropped. A call cut off by the
token limit (no closing tag) is parsed if its JSON is complete, else invalid.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

OPEN, CLOSE = "<tool_call>", "</tool_call>"

#: Tool name -> (required argument types, optional argument types).
TOOLS: dict[str, tuple[dict[str, type], dict[str, type]]] = {
    "read_file": ({"path": str}, {}),
    "edit_file": ({"path": str}, {"content": str, "old": str, "new": str}),
    "search": ({"pattern": str}, {"path": str}),
    "run": ({"command": str}, {}),
    "finish": ({}, {"message": str}),
}

TOOL_DOCS = """\
- read_file {"path": "<file>"}: show a file of the repository.
- edit_file {"path": "<file>", "content": "<whole new file>"}: write a file. Or replace one exact
  snippet: {"path": "<file>", "old": "<existing text>", "new": "<replacement>"}.
- search {"pattern": "<regex>"}: search the repository's files.
- run {"command": "<shell command>"}: run a command in the repository, e.g. python solution.py.
- finish {"message": "<what you did>"}: end the session when the work is done."""

ALIASES = {"cmd": "command", "file": "path", "filename": "path", "text": "content", "query": "pattern"}


@dataclass
class ParsedCall:
    """One tool call from a reply (valid or not).

    Attributes:
        name: the tool name, or ``invalid`` when none could be read.
        arguments: validated arguments (for an invalid call: what could be read, plus ``raw``).
        valid: whether it can run.
        error: what was wrong (sent back to the model), None when valid.
    """

    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    valid: bool = True
    error: str | None = None


def _decode_json(raw: str) -> Any:
    raw = raw.strip()
    if raw.startswith("```"):
        raw = re.sub(r"^```(?:json)?\s*|\s*```$", "", raw)
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        # Small models often emit Python-style literal newlines inside strings: allow them.
        return json.loads(raw, strict=False)


def validate_call(obj: Any) -> ParsedCall:
    """Check a decoded ``{"name", "arguments"}`` object against :data:`TOOLS`."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return ParsedCall("invalid", {"raw": str(obj)[:500]}, False, 'expected {"name": ..., "arguments": {...}}')
    name = obj["name"].strip()
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # arguments sent as a JSON string (OpenAI style)
        try:
            args = _decode_json(args)
        except json.JSONDecodeError:
            return ParsedCall(name[:64] or "invalid", {"raw": args[:500]}, False, "arguments is not a JSON object")
    if name not in TOOLS:
        return ParsedCall(
            name[:64] or "invalid",
            args if isinstance(args, dict) else {},
            False,
            f"unknown tool {name!r}; tools: {', '.join(TOOLS)}",
        )
    if not isinstance(args, dict):
        return ParsedCall(name, {"raw": str(args)[:500]}, False, "arguments must be a JSON object")
    args = {ALIASES.get(k, k): v for k, v in args.items()}
    required, optional = TOOLS[name]
    for key, _typ in required.items():
        if key not in args:
            return ParsedCall(name, args, False, f"{name} needs argument {key!r}")
    for key, value in args.items():
        typ = required.get(key) or optional.get(key)
        if typ is None:
            return ParsedCall(name, args, False, f"{name} has no argument {key!r}")
        if not isinstance(value, typ):
            return ParsedCall(name, args, False, f"{name}.{key} must be a {typ.__name__}")
    if name == "edit_file" and ("content" in args) == ("old" in args or "new" in args):
        return ParsedCall(name, args, False, 'edit_file needs either "content" or both "old" and "new"')
    if name == "edit_file" and "content" not in args and not ("old" in args and "new" in args):
        return ParsedCall(name, args, False, 'edit_file needs both "old" and "new"')
    return ParsedCall(name, args)


def parse_tool_calls(text: str) -> tuple[list[ParsedCall], str]:
    """Every tool call in a reply, plus the reply's text outside the tags (the message).

    Returns:
        ``(calls, message)``; ``calls`` is empty when the reply has no ``<tool_call>`` tag.
    """
    calls: list[ParsedCall] = []
    message_parts: list[str] = []
    pos = 0
    while True:
        start = text.find(OPEN, pos)
        if start < 0:
            message_parts.append(text[pos:])
            break
        message_parts.append(text[pos:start])
        body_start = start + len(OPEN)
        end = text.find(CLOSE, body_start)
        nxt = text.find(OPEN, body_start)
        if end < 0 or (0 <= nxt < end):  # unterminated: the body runs to the next call or the end
            stop = nxt if nxt >= 0 else len(text)
            body, pos = text[body_start:stop], stop
            closed = False
        else:
            body, pos = text[body_start:end], end + len(CLOSE)
            closed = True
        try:
            call = validate_call(_decode_json(body))
        except (json.JSONDecodeError, RecursionError) as exc:
            call = ParsedCall(
                "invalid",
                {"raw": body[:500]},
                False,
                f"tool call is not valid JSON ({exc.msg if hasattr(exc, 'msg') else exc})",
            )
        if not closed and call.valid:
            call.error = None  # complete JSON without the closing tag (cut at a stop token): accept
        calls.append(call)
    return calls, "".join(message_parts).strip()

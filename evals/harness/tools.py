"""Executing the agent's tools against the task repository.

Invariant: ``read_file``/``edit_file``/``search`` touch only paths inside the workspace
(``workspace.resolve_inside``); ``run`` executes only through the sandbox with the workspace as
its cwd. Every observation returned to the model is truncated to ``max_output_chars``.
"""

from __future__ import annotations

import difflib
import re
import time
from dataclasses import dataclass
from pathlib import Path

from evals.harness.environment import command_in_environment, has_environment
from evals.harness.sandbox import SandboxLimits, run_in_sandbox
from evals.harness.toolcalls import ParsedCall
from evals.harness.workspace import PathEscapeError, resolve_inside, snapshot

_TEST_COMMAND = re.compile(r"\b(pytest|unittest|test_\w*\.py|\w*_test\.py|_run_hidden_tests)\b")


@dataclass
class ToolOutcome:
    """What a tool did.

    Attributes:
        ok: the tool succeeded (``run``: exit code 0 within limits).
        output: the observation text for the model (truncated).
        exit_code: ``run`` only.
        ran_tests: ``run`` executed tests (pytest/unittest/a test file).
        command: ``run`` only.
        duration_s: wall-clock seconds.
        edit: for a successful ``edit_file``: ``{"path", "lines_added", "lines_removed", "diff", "added"}``.
        finished: the agent called ``finish``.
        sandbox_denials: ``run`` only: attempts the sandbox refused (``SandboxResult.denial_count``).
    """

    ok: bool
    output: str
    exit_code: int | None = None
    ran_tests: bool = False
    command: str | None = None
    duration_s: float = 0.0
    edit: dict | None = None
    finished: bool = False
    sandbox_denials: int = 0


def _truncate(text: str, limit: int) -> str:
    if len(text) <= limit:
        return text
    return text[: limit // 2] + f"\n...[{len(text) - limit} characters truncated]...\n" + text[-limit // 2 :]


def execute_tool(
    call: ParsedCall, workdir: Path, limits: SandboxLimits, *, max_output_chars: int = 3000
) -> ToolOutcome:
    """Run one valid tool call in ``workdir``; failures become ``ok=False`` observations, never raise."""
    t0 = time.perf_counter()
    try:
        out = _dispatch(call, Path(workdir), limits, max_output_chars)
    except PathEscapeError as exc:
        out = ToolOutcome(ok=False, output=f"error: {exc}")
    except (FileNotFoundError, IsADirectoryError, UnicodeDecodeError) as exc:
        out = ToolOutcome(ok=False, output=f"error: {type(exc).__name__}: {exc}")
    out.output = _truncate(out.output, max_output_chars)
    out.duration_s = out.duration_s or time.perf_counter() - t0
    return out


def _dispatch(call: ParsedCall, workdir: Path, limits: SandboxLimits, max_chars: int) -> ToolOutcome:
    args = call.arguments
    if call.name == "read_file":
        path = resolve_inside(workdir, args["path"])
        text = path.read_text(encoding="utf-8")
        numbered = "\n".join(f"{i + 1:4d} {line}" for i, line in enumerate(text.splitlines()))
        return ToolOutcome(ok=True, output=f"{args['path']}:\n{numbered}" if text else f"{args['path']} is empty")
    if call.name == "edit_file":
        return _edit(workdir, args)
    if call.name == "search":
        return _search(workdir, args["pattern"], args.get("path"))
    if call.name == "run":
        command = args["command"]
        if has_environment(workdir):  # the task's environment (Task.environment) runs the command
            command = command_in_environment(command)
        res = run_in_sandbox(command, workdir, limits)
        return ToolOutcome(
            ok=res.ok,
            output=res.observation(max_chars),
            exit_code=res.exit_code,
            ran_tests=bool(_TEST_COMMAND.search(args["command"])),
            command=args["command"],
            duration_s=res.duration_s,
            sandbox_denials=res.denial_count,
        )
    if call.name == "finish":
        return ToolOutcome(ok=True, output="session finished", finished=True)
    raise ValueError(f"unknown tool {call.name}")  # validate_call admits only known tools


def _edit(workdir: Path, args: dict) -> ToolOutcome:
    path = resolve_inside(workdir, args["path"])
    if path.is_dir():
        return ToolOutcome(ok=False, output=f"error: {args['path']} is a directory")
    before = path.read_text(encoding="utf-8") if path.exists() else ""
    if "content" in args:
        after = args["content"]
    else:
        count = before.count(args["old"]) if args["old"] else 0
        if count != 1:
            where = "not found" if count == 0 else f"found {count} times"
            return ToolOutcome(
                ok=False, output=f"error: old text {where} in {args['path']}; give a unique exact snippet"
            )
        after = before.replace(args["old"], args["new"], 1)
    if after == before:
        return ToolOutcome(ok=True, output=f"{args['path']} unchanged")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(after, encoding="utf-8")
    diff_lines = list(
        difflib.unified_diff(
            before.splitlines(), after.splitlines(), f"a/{args['path']}", f"b/{args['path']}", lineterm=""
        )
    )
    added = [ln[1:] for ln in diff_lines if ln.startswith("+") and not ln.startswith("+++")]
    removed = [ln for ln in diff_lines if ln.startswith("-") and not ln.startswith("---")]
    edit = {
        "path": args["path"],
        "lines_added": len(added),
        "lines_removed": len(removed),
        "diff": "\n".join(diff_lines)[:100_000],
        "added": added,
    }
    return ToolOutcome(ok=True, output=f"edited {args['path']} (+{len(added)} -{len(removed)} lines)", edit=edit)


def _search(workdir: Path, pattern: str, under: str | None) -> ToolOutcome:
    try:
        rx = re.compile(pattern)
    except re.error as exc:
        return ToolOutcome(ok=False, output=f"error: bad regex: {exc}")
    root = resolve_inside(workdir, under) if under else Path(workdir)
    hits = []
    for rel, text in snapshot(workdir).items():
        if under and not (Path(workdir) / rel).resolve().is_relative_to(root):
            continue
        for i, line in enumerate(text.splitlines()):
            if rx.search(line):
                hits.append(f"{rel}:{i + 1}: {line.strip()[:200]}")
    return ToolOutcome(ok=True, output="\n".join(hits[:100]) if hits else "no matches")

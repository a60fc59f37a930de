"""The command line's contract with scripts (docs/operations.md): every command that reports
something can print JSON, usage errors exit 2 on every command, and failures map to the exit-code
table (``app.core.failures``)."""

from __future__ import annotations

import click
import pytest
import typer.main

from app.core.errors import (
    CheckpointError,
    ConfigurationError,
    ConflictError,
    InfrastructureError,
    NotFoundError,
)
from app.core.failures import ExitCode, classify
from ops.cli import app, run

# Commands that print JSON whatever the flags (JSON lines or one object).
ALWAYS_JSON = {
    "consume",
    "finalize",
    "replay",
    "erase",
    "erasures list",
    "rewards show",
    "deadletters stats",
    "deadletters list",
    "deadletters redrive",
    "canary evaluate",
    "events schema",
}
# Long-running processes: they log, they do not report.
SERVICES = {"worker", "beat", "up", "demo", "serve", "watch", "api", "front", "stack broker"}


def leaf_commands() -> dict[str, click.Command]:
    """Every runnable command of ``flywheel`` by its words, e.g. ``"stack status"``."""
    found: dict[str, click.Command] = {}

    def walk(cmd: click.Command, words: list[str]) -> None:
        if hasattr(cmd, "commands"):  # a group (typer 0.29 builds its own group class)
            for name, sub in cmd.commands.items():
                walk(sub, [*words, name])
        else:
            found[" ".join(words)] = cmd

    walk(typer.main.get_command(app), [])
    return found


def test_every_reporting_command_prints_json_on_request():
    commands = leaf_commands()
    assert len(commands) >= 45
    without = sorted(
        name
        for name, cmd in commands.items()
        if name not in ALWAYS_JSON | SERVICES and not any("--json" in p.opts for p in cmd.params)
    )
    assert not without, f"reporting commands without --json (add it, or list them above with a reason): {without}"
    assert ALWAYS_JSON <= set(commands), sorted(ALWAYS_JSON - set(commands))


@pytest.mark.parametrize("words", sorted(leaf_commands()))
def test_an_unknown_option_is_a_usage_error_on_every_command(words, capsys):
    assert run([*words.split(), "--no-such-option"]) == ExitCode.USAGE
    assert "No such option" in capsys.readouterr().err


def test_the_table_maps_each_failure_once():
    assert classify(ConfigurationError("no url")).code is ExitCode.USAGE
    assert classify(InfrastructureError("vLLM down")).code is ExitCode.UNREACHABLE
    for negative in (NotFoundError("x"), ConflictError("gate not passed"), CheckpointError("torn")):
        assert classify(negative).code is ExitCode.NEGATIVE
    assert classify(ConnectionRefusedError(111, "refused")).code is ExitCode.UNREACHABLE
    assert classify(KeyError("bug")).code is ExitCode.INTERNAL


def test_a_bug_exits_4_with_its_traceback(monkeypatch, capsys):
    from ops import stack

    def broken(*_a, **_k):
        raise KeyError("a bug")

    monkeypatch.setattr(stack, "stack_down", broken)
    assert run(["stack", "down"]) == ExitCode.INTERNAL
    err = capsys.readouterr().err
    assert "Traceback" in err and "error: unexpected KeyError: 'a bug'" in err

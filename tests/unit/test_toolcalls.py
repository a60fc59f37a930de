"""Tool-call parsing: valid calls, malformed JSON, unknown tools, bad arguments, truncation."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evals.harness.toolcalls import parse_tool_calls


def call(name, **args) -> str:
    return "<tool_call>" + json.dumps({"name": name, "arguments": args}) + "</tool_call>"


def test_valid_calls_in_order_with_message():
    calls, message = parse_tool_calls(
        "Let me look. " + call("read_file", path="a.py") + "\n" + call("run", command="ls")
    )
    assert [(c.name, c.valid) for c in calls] == [("read_file", True), ("run", True)]
    assert calls[1].arguments == {"command": "ls"} and message == "Let me look."


def test_no_tool_call_is_a_message():
    calls, message = parse_tool_calls("Which file should I change?")
    assert calls == [] and message == "Which file should I change?"


@pytest.mark.parametrize(
    "text,error",
    [
        ('<tool_call>{"name": "read_file", "arguments": {"path": </tool_call>', "not valid JSON"),
        ('<tool_call>{"name": "read_file", "arguments": {"path": "a.py"}', "not valid JSON"),  # cut off
        ("<tool_call>[1, 2]</tool_call>", "expected"),
        ('<tool_call>{"name": "rm_rf", "arguments": {}}</tool_call>', "unknown tool"),
        ('<tool_call>{"name": "run", "arguments": {}}</tool_call>', "needs argument 'command'"),
        ('<tool_call>{"name": "run", "arguments": {"command": 3}}</tool_call>', "must be a str"),
        (
            '<tool_call>{"name": "run", "arguments": {"command": "ls", "shell": true}}</tool_call>',
            "no argument 'shell'",
        ),
        ('<tool_call>{"name": "edit_file", "arguments": {"path": "a.py"}}</tool_call>', "either"),
        ('<tool_call>{"name": "edit_file", "arguments": {"path": "a.py", "old": "x"}}</tool_call>', "both"),
        ('<tool_call>{"name": "run", "arguments": "not json"}</tool_call>', "not a JSON object"),
    ],
)
def test_malformed_calls_are_invalid_with_a_reason(text, error):
    calls, _ = parse_tool_calls(text)
    assert len(calls) == 1 and not calls[0].valid and error in calls[0].error


def test_unterminated_call_followed_by_another_yields_both():
    text = '<tool_call>{"name": "run", "arguments": {"command": "ls"}}' + call("finish")
    calls, _ = parse_tool_calls(text)
    assert [(c.name, c.valid) for c in calls] == [("run", True), ("finish", True)]


def test_aliases_string_arguments_and_literal_newlines():
    calls, _ = parse_tool_calls(
        '<tool_call>{"name": "run", "arguments": "{\\"cmd\\": \\"ls\\"}"}</tool_call>'
        '<tool_call>{"name": "edit_file", "arguments": {"path": "a.py", "content": "x = 1\ny = 2"}}'
        "</tool_call>"
    )
    assert calls[0].arguments == {"command": "ls"} and calls[0].valid
    assert calls[1].valid and calls[1].arguments["content"] == "x = 1\ny = 2"


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=200))
def test_parser_never_raises_and_counts_every_opening_tag(text):
    calls, _ = parse_tool_calls(text)
    assert len(calls) == text.count("<tool_call>")

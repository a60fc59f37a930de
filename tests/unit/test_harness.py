"""The agent loop: event order, token-exact segments, self-summarization, invalid calls, grading."""

from __future__ import annotations

import pytest
import torch

from app.inference.engine import SamplingParams
from evals.harness.agent import AgentBudget, grade, run_agent_session
from evals.harness.scripted import ScriptedPolicy, tool_call
from evals.tasks.model import HIDDEN_RUNNER, Task, hidden_runner

TASK = Task(
    id="toy/add",
    source="toy",
    split="train",
    request="Implement add(a, b) in solution.py.",
    files={"solution.py": "def add(a, b):\n    raise NotImplementedError\n"},
    test_command=f"python {HIDDEN_RUNNER}",
    test_files={
        "test_hidden.py": "assert add(2, 3) == 5\nassert add(-1, 1) == 0\n",
        HIDDEN_RUNNER: hidden_runner("", "\n", "test_hidden.py"),
    },
    reference_files={"solution.py": "def add(a, b):\n    return a + b\n"},
    metadata={"entry_point": "add"},
)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def run(policy, tmp_path, budget=AgentBudget(max_turns=12), **kw):
    sent = []
    result = run_agent_session(
        policy,
        TASK,
        tmp_path / "repo",
        budget,
        SamplingParams(max_tokens=400),
        emit=sent.append,
        session_id="s-1",
        user_id="u-1",
        **kw,
    )
    assert sent == result.events
    return result


def segments_of(events):
    segs: dict[int, list[int]] = {}
    for e in events:
        if e.type == "model.responded":
            segs.setdefault(e.payload.segment_index, []).extend(
                e.payload.prompt_token_ids + e.payload.completion_token_ids
            )
    return segs


def test_scripted_reference_passes_and_events_follow_the_contract(tokenizer, tmp_path):
    policy = ScriptedPolicy.submitting(
        tokenizer, TASK, run_command="python -c 'from solution import add; print(add(1, 2))'"
    )
    result = run(policy, tmp_path, on_end=lambda r: ("edit.persistence_measured",))
    types = [e.type for e in result.events]
    assert types[:2] == ["session.started", "agent.requested"] and types[-1] == "session.ended"
    assert result.events[-1].payload.expected_signals == ("edit.persistence_measured",)
    assert result.reason == "finished" and result.edited and result.tool_call_errors == 0
    assert types.count("model.responded") == result.turns == 4 and types.count("edit.proposed") == 1
    run_event = [e for e in result.events if e.type == "tool.executed" and e.payload.name == "run"][0]
    assert run_event.payload.ok and "3" in run_event.payload.output
    assert result.final_files["solution.py"] == TASK.reference_files["solution.py"]
    assert grade(TASK, tmp_path / "repo")
    assert all(e.session_id == "s-1" and e.user_id == "u-1" for e in result.events)


def test_a_failing_end_hook_still_ends_the_session(tokenizer, tmp_path):
    # The simulator's developer grades in its on_end hook; a grader that raises must not leave the
    # session open (its trajectory would wait out the whole signal window).
    def broken_grader(result):
        raise RuntimeError("the sandbox cannot be built here")

    sent = []
    policy = ScriptedPolicy.submitting(tokenizer, TASK)
    with pytest.raises(RuntimeError, match="sandbox"):
        run_agent_session(
            policy, TASK, tmp_path / "repo", AgentBudget(max_turns=12), SamplingParams(max_tokens=400),
            emit=sent.append, session_id="s-1", user_id="u-1", on_end=broken_grader,
        )  # fmt: skip
    assert sent[-1].type == "session.ended" and sent[-1].payload.reason == "error"
    assert [e.type for e in sent].count("session.ended") == 1


def test_prompt_tokens_are_exactly_the_appended_tokens(tokenizer, tmp_path):
    policy = ScriptedPolicy.submitting(tokenizer, TASK)
    result = run(policy, tmp_path)
    responded = [e.payload for e in result.events if e.type == "model.responded"]
    sequence: list[int] = []
    for seen_by_engine, p in zip(policy.prompts, responded, strict=True):
        sequence += p.prompt_token_ids
        assert seen_by_engine == sequence  # the engine saw exactly the concatenation so far
        sequence += p.completion_token_ids
    assert segments_of(result.events)[0] == sequence


def test_context_limit_summarizes_into_new_segments(tokenizer, tmp_path):
    reads = [tool_call("read_file", path="solution.py")] * 6
    policy = ScriptedPolicy(tokenizer, reads + [tool_call("finish")])
    result = run(policy, tmp_path, budget=AgentBudget(max_turns=30, context_tokens=700, max_tokens_per_turn=100))
    summaries = [e.payload for e in result.events if e.type == "context.summarized"]
    assert result.segments == len(summaries) + 1 >= 2
    assert [s.new_segment_index for s in summaries] == list(range(1, len(summaries) + 1))
    assert all(s.summarized_tokens > 0 and "Summary" in s.summary for s in summaries)
    segs = segments_of(result.events)
    assert sorted(segs) == list(range(result.segments))
    assert all(len(tokens) <= 700 + 100 for tokens in segs.values())  # + one summary turn
    turns = [(e.payload.segment_index, e.payload.turn_index) for e in result.events if e.type == "model.responded"]
    for seg in segs:  # turn_index restarts at 0 in each segment and counts up
        assert [t for s, t in turns if s == seg] == list(range(sum(1 for s, _ in turns if s == seg)))
    # each segment's concatenation is exactly the last context the engine saw in that segment
    last_prompt_of = {}
    idx = 0
    for e in result.events:
        if e.type == "model.responded":
            last_prompt_of[e.payload.segment_index] = policy.prompts[idx] + list(e.payload.completion_token_ids)
            idx += 1
    assert last_prompt_of == segs


def test_invalid_calls_are_answered_and_counted(tokenizer, tmp_path):
    policy = ScriptedPolicy(
        tokenizer,
        [
            '<tool_call>{"name": "read_file", "arguments": {"path": ',
            tool_call("delete_everything"),
            tool_call("read_file", path="../../../etc/passwd"),
            tool_call("finish"),
        ],
    )
    result = run(policy, tmp_path)
    assert result.tool_call_errors == 2 and result.tool_calls == 4
    calls = [c for e in result.events if e.type == "model.responded" for c in e.payload.tool_calls]
    assert [c.valid for c in calls] == [False, False, True, True]
    assert "invalid tool call" in tokenizer.decode(policy.prompts[1][-120:])
    escaped = [e.payload for e in result.events if e.type == "tool.executed" and e.payload.name == "read_file"]
    assert not escaped[0].ok and "outside the repository" in escaped[0].output


def test_budgets_end_the_session(tokenizer, tmp_path):
    looping = ScriptedPolicy(tokenizer, [tool_call("search", pattern="def")] * 50)
    by_turns = run(looping, tmp_path / "a", budget=AgentBudget(max_turns=3))
    assert by_turns.reason == "turns" and by_turns.turns == 3
    by_tokens = run(
        ScriptedPolicy(tokenizer, [tool_call("search", pattern="def")] * 50),
        tmp_path / "b",
        budget=AgentBudget(max_turns=50, max_completion_tokens=60),
    )
    assert by_tokens.reason == "budget" and by_tokens.completion_tokens >= 60


def test_question_without_tool_call_ends_the_turn(tokenizer, tmp_path):
    result = run(ScriptedPolicy(tokenizer, ["Should add handle strings too?"]), tmp_path)
    assert result.asked_question and result.turns == 1 and not result.edited


def test_wrong_solution_fails_the_hidden_tests(tokenizer, tmp_path):
    policy = ScriptedPolicy(
        tokenizer,
        [
            tool_call("edit_file", path="solution.py", old="raise NotImplementedError", new="return a - b"),
            tool_call("finish"),
        ],
    )
    result = run(policy, tmp_path)
    assert result.edits[0]["lines_added"] == 1 and not grade(TASK, tmp_path / "repo")


def test_real_engine_logprobs_in_events_match_the_reconstructed_sequence(tiny_model_dir, tmp_path):
    from serving.reference_engine import ReferenceEngine, teacher_forced_logprobs

    engine = ReferenceEngine(tiny_model_dir, checkpoint_id="tiny", num_threads=1)
    result = run_agent_session(
        engine,
        TASK,
        tmp_path / "repo",
        AgentBudget(max_turns=2, max_tokens_per_turn=12),
        SamplingParams(max_tokens=12, temperature=1.0, seed=0),
        session_id="s",
        user_id="u",
    )
    (p,) = [e.payload for e in result.events if e.type == "model.responded"][:1]
    assert p.checkpoint_id == "tiny" and len(p.completion_token_ids) == 12
    ref = teacher_forced_logprobs(engine.model, list(p.prompt_token_ids), list(p.completion_token_ids), 1.0)
    assert torch.allclose(torch.tensor(p.completion_logprobs), ref, atol=1e-4)


def test_code_in_a_final_reply_is_applied_like_the_editors_apply_button(tokenizer, tmp_path):
    reply = "Here is the fix:\n```python\ndef add(a, b):\n    return a + b\n```\nDoes that help?"
    result = run(ScriptedPolicy(tokenizer, [reply]), tmp_path)
    assert result.edited and result.tool_calls == 0 and result.tool_call_errors == 0
    assert not result.asked_question  # the code was applied: an answer, not a question
    (edit,) = [e.payload for e in result.events if e.type == "edit.proposed"]
    assert edit.edit_id.startswith("apply-") and edit.path == "solution.py"
    assert grade(TASK, tmp_path / "repo")
    unapplied = run(
        ScriptedPolicy(tokenizer, ["```python\ndef subtract(a, b):\n    return a - b\n```"]), tmp_path / "b"
    )
    assert not unapplied.edited  # it does not define the entry point


def test_first_prompt_asks_for_a_code_block_and_shows_the_file_in_one(tokenizer, tmp_path):
    from evals.harness.chat import REPLY_INSTRUCTION, TOOL_PROMPT, ChatML

    policy = ScriptedPolicy(tokenizer, ["```python\ndef add(a, b):\n    return a + b\n```"])
    result = run(policy, tmp_path)
    text = tokenizer.decode(policy.prompts[0])
    system = ChatML(tokenizer).system_prompt
    assert system.endswith(TOOL_PROMPT) and system in text and "<tool_call>" in system
    assert all(name in system for name in ("read_file", "edit_file", "search", "run", "finish"))
    assert "solution.py:\n```python\ndef add(a, b):\n    raise NotImplementedError\n```" in text
    assert text.index(TASK.request) < text.index("solution.py:\n```python") < text.index(REPLY_INSTRUCTION)
    assert "python code block" in REPLY_INSTRUCTION
    assert len(tokenizer(system).input_ids) < 250  # context paid at every turn and training step
    assert result.edited and grade(TASK, tmp_path / "repo")  # the answer in that format is applied


def test_system_prompt_keeps_the_models_own_default(tokenizer):
    from evals.harness.chat import FALLBACK_SYSTEM, TOOL_PROMPT, ChatML

    probe = tokenizer.apply_chat_template(
        [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
    )
    system = ChatML(tokenizer).system_prompt
    if probe.startswith("<|im_start|>system\n"):  # the template inserts a default system turn
        default = probe.split("\n", 1)[1].split("<|im_end|>", 1)[0].strip()
        assert default and system.startswith(default.rstrip("."))
    else:
        assert system.startswith(FALLBACK_SYSTEM.rstrip("."))
    assert system.endswith(TOOL_PROMPT)


def test_repository_message_lists_files_too_large_to_show(tmp_path):
    from evals.harness.chat import repository_message

    (tmp_path / "solution.py").write_text("x = 1\n")
    (tmp_path / "data.csv").write_text("a,b\n" * 2000)
    msg = repository_message("Fix it.", tmp_path)
    assert msg.startswith("Fix it.") and "solution.py:\n```python\nx = 1\n```" in msg
    assert "Other files: data.csv" in msg and "a,b" not in msg

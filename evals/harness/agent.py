"""The product's agent loop — the same code serves editor sessions (simulator) and evals.

Invariants:
- Every event of the contract a session produces goes through ``emit`` (when given) in causal
  order: ``session.started``, ``agent.requested``, then per turn ``model.responded`` followed by
  its ``tool.executed`` (and ``edit.proposed``) events, ``context.summarized`` at a segment
  boundary, and last ``session.ended`` (the events are built by ``session_events.py``).
- ``model.responded`` carries the real token ids and behaviour log-probs; its
  ``prompt_token_ids`` are exactly the tokens appended since the previous turn of the same
  segment (see ``chat.py``), so ``concat(prompt_i + completion_i)`` over a segment's turns is the
  token sequence the model saw. ``turn_index`` counts turns within a segment.
- The context never exceeds ``AgentBudget.context_tokens`` plus one summary turn: when the next
  turn would not fit, the model is asked to summarize, the context restarts from the summary
  (and the pending tool results), and a new segment begins.
- An invalid tool call is answered with an error observation and counted; the session goes on.
- A final reply without tool calls (or a ``finish`` call) answers the current request; code in
  the reply that defines the request's entry point is applied to the main file as an edit
  (``apply.py``), like an editor's Apply button. The session ends there unless the task has
  follow-ups (``Task.followups``): the next one is sent as a user turn of the same segment, after
  its ``agent.requested``, and a segment restarted by a summary shows the current request.
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

from app.inference.engine import InferenceEngine, SamplingParams
from evals.harness.apply import apply_target, extract_code
from evals.harness.chat import SUMMARY_REQUEST, ChatML, followup_message, repository_message
from evals.harness.environment import command_in_environment, materialize_environment
from evals.harness.sandbox import SandboxLimits, SandboxResult, run_in_sandbox
from evals.harness.session_events import SessionEvents
from evals.harness.toolcalls import ParsedCall, parse_tool_calls
from evals.harness.tools import execute_tool
from evals.harness.workspace import snapshot, write_files
from producers.events.types import EventBase, ToolCall


@dataclass(frozen=True)
class AgentBudget:
    """Limits of one session.

    Attributes:
        max_turns: model turns (summary turns included).
        max_completion_tokens: completion tokens over the session.
        context_tokens: the context the harness keeps before it self-summarizes (tokens).
        max_tokens_per_turn: completion tokens of one turn.
        summary_tokens: completion tokens of a summary turn.
        tool_output_chars: characters of one tool observation shown to the model.
    """

    max_turns: int = 8
    max_completion_tokens: int = 2048
    context_tokens: int = 4096
    max_tokens_per_turn: int = 512
    summary_tokens: int = 200
    tool_output_chars: int = 3000


@dataclass
class SessionResult:
    """What happened in a session (the eval runner and the simulator read it).

    ``passed`` is the outcome of the agent's last test run (None: it ran none) — not the hidden
    grade, which :func:`grade` computes. ``sandbox_denials`` counts what the session's ``run``
    commands tried and the sandbox refused (reads/writes outside the folder, network). ``edits`` lists successful ``edit_file`` calls
    (``edit_id``, ``path``, ``lines_added``, ``lines_removed``, ``added`` lines).
    """

    passed: bool | None
    edited: bool
    asked_question: bool
    turns: int
    completion_tokens: int
    latency_s: float
    tool_calls: int
    tool_call_errors: int
    test_runs: int
    segments: int
    final_files: dict[str, str]
    events: list[EventBase]
    reason: str = "finished"
    edits: list[dict] = field(default_factory=list)
    final_message: str = ""
    sandbox_denials: int = 0


def run_agent_session(
    engine: InferenceEngine,
    task,
    workdir: Path,
    budget: AgentBudget,
    sampling: SamplingParams,
    *,
    emit: Callable[[EventBase], None] | None = None,
    session_id: str,
    user_id: str,
    org_id: str = "default",
    privacy_mode: bool = False,
    limits: SandboxLimits | None = None,
    on_end: Callable[[SessionResult], Sequence[str]] | None = None,
    apply_code: bool = True,
) -> SessionResult:
    """Run the agent on ``task`` in ``workdir`` (the task's files are written there first).

    Args:
        engine: the serving policy (or a ``ScriptedPolicy``).
        task: an ``evals.tasks.model.Task``.
        workdir: an empty or scratch directory; it holds the repository after the session.
        budget, sampling: limits and decoding (``sampling.max_tokens`` is capped per turn).
        emit: receives every event (``EventProducer.emit`` in the simulator; None in evals).
        limits: sandbox limits of the ``run`` tool (default 30 s, 2 GiB).
        on_end: computes ``session.ended.expected_signals`` from the result (the simulator says
            which late signals will follow).
        apply_code: a final reply without tool calls that holds code defining the entry point is
            applied to the main file (the editor's Apply button; see ``apply.py``).

    Returns:
        The :class:`SessionResult` (``events`` holds every event, emitted or not).
    """
    run = _Session(
        engine,
        task,
        Path(workdir),
        budget,
        sampling,
        emit,
        limits or SandboxLimits(),
        dict(session_id=session_id, user_id=user_id, org_id=org_id, privacy_mode=privacy_mode),
    )
    run.apply_code = apply_code
    try:
        run.loop()
    except BaseException:
        run.end("error", ())
        raise
    result = run.result()
    try:
        expected = tuple(on_end(result)) if on_end else ()
    except BaseException:
        run.end("error", ())  # a failed hook (e.g. grading) still ends the session: it must not stay open
        raise
    run.end(run.reason, expected)
    result.events = run.events
    return result


@dataclass
class _Reply:
    token_ids: list[int]
    finish_reason: str
    calls: list
    message: str
    tool_calls: tuple[ToolCall, ...]


class _Session:
    def __init__(self, engine, task, workdir, budget, sampling, emit, limits, envelope) -> None:
        self.engine, self.task, self.workdir, self.budget = engine, task, workdir, budget
        self.sampling, self.limits = sampling, limits.with_packages(task.environment)  # the task's own too
        self.log = SessionEvents(envelope, emit)
        self.chat = ChatML(engine.tokenizer)
        self.segment, self.turn_in_segment, self.turns = 0, 0, 0
        self.context: list[int] = []
        self.completion_tokens, self.latency_s = 0, 0.0
        self.tool_calls = self.tool_errors = self.test_runs = self.sandbox_denials = 0
        self.last_test_ok: bool | None = None
        self.asked_question, self.reason, self.final_message = False, "turns", ""
        self.edits: list[dict] = []
        self.apply_code = True
        self.request, self.entry_point = task.request, task.metadata.get("entry_point")
        self.followups = list(task.followups)

    @property
    def events(self) -> list[EventBase]:
        return self.log.events

    def end(self, reason: str, expected: tuple[str, ...]) -> None:
        self.log.session_ended(reason, self.turns, self.test_runs > 0, expected)

    # ---- loop ----------------------------------------------------------------------------

    def loop(self) -> None:
        self.workdir.mkdir(parents=True, exist_ok=True)
        write_files(self.workdir, self.task.files)
        if self.task.environment is not None:  # the agent's test runs see what the grade will
            materialize_environment(self.workdir, self.task.environment)
        self.log.session_started(self.task.id, self.task.source, self.engine.checkpoint_id)
        self.log.agent_requested(self.task.request)
        pending = self.chat.first_prompt(self.chat.system_prompt, repository_message(self.task.request, self.workdir))
        last_completion: list[int] = []
        observations: str | None = None
        while True:
            if self.turns >= self.budget.max_turns:
                self.reason = "turns"
                return
            remaining = self.budget.max_completion_tokens - self.completion_tokens
            if remaining <= 0:
                self.reason = "budget"
                return
            max_new = min(self.budget.max_tokens_per_turn, self.sampling.max_tokens, remaining)
            if len(self.context) + len(pending) + max_new > self.budget.context_tokens:
                if self.context:  # summarize, then restart the context in a new segment
                    pending = self.summarize(last_completion, observations)
                    last_completion = []
                    continue
                max_new = self.budget.context_tokens - len(pending)
                if max_new < 16:
                    self.reason = "context"
                    return
            completion = self.respond(pending, max_new)
            last_completion = completion.token_ids
            outcome = self.act(completion)
            if outcome is None:  # the request is answered: the developer's next one, if any
                if not self.followups:
                    return
                step = self.followups.pop(0)
                self.request, self.entry_point = step.request, step.entry_point or self.entry_point
                self.log.agent_requested(step.request)
                observations = None
                pending = self.chat.continuation(last_completion, followup_message(step.request))
                continue
            observations = outcome
            pending = self.chat.continuation(last_completion, observations)

    def respond(self, pending: list[int], max_new: int, tool_free: bool = False):
        params = replace(
            self.sampling,
            max_tokens=max_new,
            seed=None if self.sampling.seed is None else self.sampling.seed + self.turns,
        )
        gen = self.engine.generate([self.context + pending], params)[0]
        self.context += pending + gen.token_ids
        self.completion_tokens += len(gen.token_ids)
        self.latency_s += gen.latency_s
        text = self.chat.decode_reply(gen.token_ids)
        calls, message = ([], text) if tool_free else parse_tool_calls(text)
        reply = _Reply(
            gen.token_ids,
            gen.finish_reason,
            calls,
            message,
            tuple(
                ToolCall(call_id=f"call-{self.turns}-{i}", name=c.name, arguments=c.arguments, valid=c.valid)
                for i, c in enumerate(calls)
            ),
        )
        self.log.model_responded(
            segment_index=self.segment,
            turn_index=self.turn_in_segment,
            checkpoint_id=self.engine.checkpoint_id,
            prompt_token_ids=pending,
            generation=gen,
            tool_calls=reply.tool_calls,
        )
        self.turns += 1
        self.turn_in_segment += 1
        return reply

    def act(self, gen: "_Reply") -> str | None:
        """Run the reply's tool calls; the observation text, or None when the session ends."""
        if not gen.calls:
            self.final_message = gen.message
            self.reason = "finished"
            if not (self.apply_code and self.apply_reply(gen.message)):
                self.asked_question = "?" in gen.message
            return None
        parts, finished = [], False
        for call, tc in zip(gen.calls, gen.tool_calls):
            self.tool_calls += 1
            if not call.valid:
                self.tool_errors += 1
                hint = "" if gen.finish_reason != "length" else " (the reply hit the per-turn token limit)"
                text = (
                    f"error: invalid tool call: {call.error}{hint}. Write "
                    '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call>'
                )
                self.log.tool_executed(tc.call_id, tc.name, ok=False, output=text)
                parts.append(f"<tool_response>\n{text}\n</tool_response>")
                continue
            out = execute_tool(call, self.workdir, self.limits, max_output_chars=self.budget.tool_output_chars)
            self.sandbox_denials += out.sandbox_denials
            if out.ran_tests:
                self.test_runs += 1
                self.last_test_ok = out.ok
            self.log.tool_executed(
                tc.call_id,
                call.name,
                ok=out.ok,
                output=out.output,
                exit_code=out.exit_code,
                duration_s=out.duration_s,
                ran_tests=out.ran_tests,
                command=out.command,
                sandbox_denials=out.sandbox_denials,
            )
            if out.edit:
                edit_id = f"edit-{tc.call_id}"
                self.edits.append({"edit_id": edit_id, **out.edit})
                self.log.edit_proposed(edit_id, out.edit)
            parts.append(f"<tool_response>\n[{call.name}] {out.output}\n</tool_response>")
            if out.finished:
                finished = True
                self.final_message = call.arguments.get("message", "")
                break
        if finished:
            self.reason = "finished"
            return None
        return "\n".join(parts)

    def apply_reply(self, message: str) -> bool:
        """Apply the reply's code to the main file (see ``apply.py``); whether an edit was made."""
        target = apply_target(self.task.files)
        code = extract_code(message, self.entry_point) if target else None
        if code is None:
            return False
        out = execute_tool(ParsedCall("edit_file", {"path": target, "content": code}), self.workdir, self.limits)
        if not out.edit:
            return False
        edit_id = f"apply-{self.turns - 1}"
        self.edits.append({"edit_id": edit_id, "applied": True, **out.edit})
        self.log.edit_proposed(edit_id, out.edit)
        return True

    def summarize(self, last_completion: list[int], observations: str | None) -> list[int]:
        """Ask for a summary (a turn of the old segment), emit ``context.summarized``, and return the
        first prompt of the new segment."""
        request = self.chat.continuation(last_completion, SUMMARY_REQUEST)
        gen = self.respond(request, self.budget.summary_tokens, tool_free=True)
        summary = gen.message.strip() or "(no summary)"
        replaced = len(self.context)
        self.segment += 1
        self.turn_in_segment = 0
        self.context = []
        self.log.context_summarized(self.segment, summary, replaced)
        user = repository_message(self.request, self.workdir, summary=summary, observations=observations)
        return self.chat.first_prompt(self.chat.system_prompt, user)

    def result(self) -> SessionResult:
        return SessionResult(
            passed=self.last_test_ok,
            edited=bool(self.edits),
            asked_question=self.asked_question,
            turns=self.turns,
            completion_tokens=self.completion_tokens,
            latency_s=self.latency_s,
            tool_calls=self.tool_calls,
            tool_call_errors=self.tool_errors,
            test_runs=self.test_runs,
            segments=self.segment + 1,
            final_files=snapshot(self.workdir),
            events=self.events,
            reason=self.reason,
            edits=self.edits,
            final_message=self.final_message,
            sandbox_denials=self.sandbox_denials,
        )


def grade_result(task, workdir: Path, limits: SandboxLimits | None = None) -> SandboxResult:
    """Run the task's hidden tests on a copy of ``workdir`` (the agent's repository is untouched),
    in the task's environment when it names one (a fresh one: the agent's is not copied)."""
    scratch = Path(tempfile.mkdtemp(prefix="flywheel-grade-"))
    try:
        write_files(scratch, snapshot(workdir))
        write_files(scratch, task.test_files)  # hidden files win over same-named agent files
        command = task.test_command
        if task.environment is not None:
            materialize_environment(scratch, task.environment)
            command = command_in_environment(command)
        limits = (limits or SandboxLimits(timeout_s=60)).with_packages(task.environment)
        return run_in_sandbox(command, scratch, limits)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def grade(task, workdir: Path, limits: SandboxLimits | None = None) -> bool:
    """Whether the repository in ``workdir`` passes the task's hidden tests (in the sandbox)."""
    return grade_result(task, workdir, limits).ok

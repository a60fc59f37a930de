"""Token-exact chat rendering for the agent loop (ChatML: SmolLM2, Qwen).

Invariant: the harness never re-tokenizes a conversation. A segment's token sequence is built
by appending (1) the first prompt, rendered once by the model's own chat template, then for each
later turn (2) the continuation tokens (closing ``<|im_end|>`` if the completion lacked it, the
user/tool turn, and the next assistant header). So the tokens the model saw are exactly
``prompt_0 + completion_0 + prompt_1 + completion_1 + ...`` — what ``model.responded`` carries.
"""

from __future__ import annotations

from pathlib import Path

from app.core.errors import ConfigurationError
from evals.harness.workspace import snapshot

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

TOOL_PROMPT = (
    "To use a tool instead of answering with code, write "
    '<tool_call>{"name": "<tool>", "arguments": {...}}</tool_call> with a tool among read_file(path), '
    "edit_file(path, content), search(pattern), run(command), finish(message)."
)
"""The product's sentence on tool calls, appended to the model's own default system prompt."""

FALLBACK_SYSTEM = "You are a coding assistant in a code editor."
"""The first sentence of the system prompt for a chat template without a default system prompt."""

REPLY_INSTRUCTION = "Reply with the complete new file in one python code block."
"""Last line of the first user turn: the editor applies the reply's code block to the file."""

SUMMARY_REQUEST = (
    "The context is full. Write a short summary of the task, what you have done so far, the current "
    "state of the code and what remains to do. Do not call tools."
)


class ChatML:
    """Renders turns as token ids for a ChatML tokenizer.

    Raises:
        ConfigurationError: the tokenizer's chat template is not ChatML (no ``<|im_start|>``).
    """

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        probe = tokenizer.apply_chat_template(
            [{"role": "user", "content": "x"}], add_generation_prompt=True, tokenize=False
        )
        if IM_START not in probe or not probe.endswith(f"{IM_START}assistant\n"):
            raise ConfigurationError("the agent harness needs a ChatML chat template (SmolLM2, Qwen)")
        self.im_end_id = tokenizer.convert_tokens_to_ids(IM_END)
        default = ""
        if probe.startswith(f"{IM_START}system\n"):
            default = probe[len(IM_START) + len("system\n") :].split(IM_END, 1)[0].strip()
        self.system_prompt = f"{(default or FALLBACK_SYSTEM).rstrip('.')}. {TOOL_PROMPT}"
        """The product's system prompt: the model's own default one (what its chat template inserts
        when a conversation has none, e.g. SmolLM2's identity line) and :data:`TOOL_PROMPT`. A
        replaced identity line cost the 135M model measurably (docs/tasks.md)."""

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text`` (special-token markup recognised, no BOS/EOS added)."""
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def first_prompt(self, system: str, user: str) -> list[int]:
        """System + user turn + assistant header, rendered by the model's own template."""
        text = self.tokenizer.apply_chat_template(
            [{"role": "system", "content": system}, {"role": "user", "content": user}],
            add_generation_prompt=True,
            tokenize=False,
        )
        return self.encode(text)

    def continuation(self, previous_completion: list[int], user: str) -> list[int]:
        """Tokens after a completion: close it if needed, a user turn, the next assistant header."""
        close = "" if previous_completion and previous_completion[-1] == self.im_end_id else IM_END
        return self.encode(f"{close}\n{IM_START}user\n{user}{IM_END}\n{IM_START}assistant\n")

    def decode_reply(self, completion: list[int]) -> str:
        """The assistant's text (up to its ``<|im_end|>``)."""
        text = self.tokenizer.decode(completion, skip_special_tokens=False)
        return text.split(IM_END, 1)[0]


def followup_message(request: str) -> str:
    """The user turn of a developer's follow-up request in the same session: the request, then
    :data:`REPLY_INSTRUCTION` (the files are in the context already)."""
    return f"{request.strip()}\n\n{REPLY_INSTRUCTION}"


def repository_message(
    request: str,
    workdir: Path,
    *,
    max_file_chars: int = 3000,
    max_total_chars: int = 6000,
    summary: str | None = None,
    observations: str | None = None,
) -> str:
    """The first user turn of a segment: the request, then small files inline in code blocks.

    A file shows as ``path:`` and a fenced block (the language from its extension), the format the
    model is asked to answer in; files too large to inline are listed by path. After a
    self-summarization the summary and the pending tool results follow, and the files are shown as
    they are now. The turn ends with :data:`REPLY_INSTRUCTION`.
    """
    files = snapshot(workdir)
    parts, listed = [request.strip()], []
    budget = max_total_chars
    for path, text in files.items():
        if len(text) <= max_file_chars and len(text) <= budget:
            lang = "python" if path.endswith(".py") else ""
            parts += ["", f"{path}:", f"```{lang}", text.rstrip(), "```"]
            budget -= len(text)
        else:
            listed.append(path)
    if listed or not files:
        parts += ["", "Other files: " + (", ".join(listed) or "(none)")]
    if summary is not None:
        parts += ["", "Summary of your work so far:", summary.strip()]
    if observations:
        parts += ["", "Latest tool results:", observations]
    parts += ["", REPLY_INSTRUCTION]
    return "\n".join(parts)

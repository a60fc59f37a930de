"""A scripted policy: an engine that replies with predetermined text (tests, smoke runs).

Invariant: it goes through the same interface as a model — token ids in, token ids and
log-probs out — so the harness, the events and the consumers cannot tell it from a real
engine. Its behaviour distribution puts all mass on the scripted reply, so each log-prob is 0.
A summary request (the harness's ``SUMMARY_REQUEST``) is answered with a canned summary without
consuming a scripted reply.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path

from app.inference.engine import Generation, InferenceEngine, SamplingParams


def tool_call(name: str, **arguments) -> str:
    """One call in the harness's format."""
    return "<tool_call>" + json.dumps({"name": name, "arguments": arguments}) + "</tool_call>"


class ScriptedPolicy(InferenceEngine):
    """Replies with ``replies`` in order (then ``finish``), each ended by ``<|im_end|>``.

    Args:
        tokenizer: a ChatML tokenizer (e.g. from ``tiny_model_dir`` or the SmolLM2 cache).
        replies: reply texts, one per model turn.
        checkpoint_id: reported as the serving checkpoint.
    """

    def __init__(self, tokenizer, replies: Iterable[str], checkpoint_id: str = "scripted") -> None:
        self.tokenizer = tokenizer
        self.replies = list(replies)
        self.checkpoint_id = checkpoint_id
        self.prompts: list[list[int]] = []
        self._end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    @classmethod
    def submitting(
        cls, tokenizer, task, *, run_command: str | None = "python solution.py", extra_replies: Iterable[str] = ()
    ) -> "ScriptedPolicy":
        """A policy that reads the files, writes the task's reference files, runs a command, finishes."""
        replies = [tool_call("read_file", path=p) for p in task.files]
        replies += [tool_call("edit_file", path=p, content=text) for p, text in task.reference_files.items()]
        replies += list(extra_replies)
        if run_command:
            replies.append(tool_call("run", command=run_command))
        replies.append(tool_call("finish", message="done"))
        return cls(tokenizer, replies)

    def generate(self, prompts: list[list[int]], params: SamplingParams) -> list[Generation]:
        out = []
        for prompt in prompts:
            self.prompts.append(list(prompt))
            tail = self.tokenizer.decode(prompt[-80:])
            if "The context is full" in tail:
                text = "Summary: I read the files and am editing solution.py."
            else:
                text = self.replies.pop(0) if self.replies else tool_call("finish", message="done")
            ids = list(self.tokenizer(text, add_special_tokens=False).input_ids)
            finish = "stop"
            if len(ids) + 1 > params.max_tokens:
                ids, finish = ids[: params.max_tokens], "length"
            else:
                ids.append(self._end)
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason=finish, latency_s=0.0))
        return out

    def load_checkpoint(self, checkpoint_id: str, path: Path) -> None:
        self.checkpoint_id = checkpoint_id

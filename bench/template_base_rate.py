"""Base pass rate of the real SmolLM2-135M-Instruct per ``functions`` template: which kinds of request
sit at production difficulty, to choose a split's templates by (``evals/functions_splits.toml``).

For each template named (default: every template of ``--split``), its first ``--variants`` tasks
are asked ``--samples`` times at ``--temperature`` (the serving temperature, 0.7) in the harness's
first turn: the product's system prompt and repository message (``evals.harness.chat``), sampled with
Hugging Face ``generate`` from the project's converted base checkpoint
(``app.checkpoints.publish.converted_base_dir``, fp32). The reply's code is applied as the editor's
Apply button does (``evals.harness.apply.extract_code``) and graded by the task's hidden tests in the
sandbox (``evals.harness.agent.grade``). One turn only: the harness's later turns (a tool call, a
retry) are left out, so this is a lower bound of what ``flywheel eval`` measures with
``max_turns = 2``; the model answers once with a code block almost always (docs/tasks.md).

Prints one line per template to stderr and one JSON line at the end (``templates``: ``{key: [n,
passed]}``, ``pass_rate``, ``seconds``); ``--out JSON`` writes the same. ``--max-seconds`` stops
after the template that crosses it (the line says so: ``complete`` false).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.checkpoints.publish import converted_base_dir
from evals.harness.agent import grade
from evals.harness.apply import apply_target, extract_code
from evals.harness.chat import ChatML, repository_message
from evals.harness.workspace import write_files
from evals.tasks import functions
from evals.tasks.model import Task


def first_prompt(chat: ChatML, task: Task) -> list[int]:
    """The harness's first prompt for ``task`` (its files written to a scratch folder to render)."""
    with tempfile.TemporaryDirectory(prefix="flywheel-rate-") as tmp:
        write_files(Path(tmp), task.files)
        return chat.first_prompt(chat.system_prompt, repository_message(task.request, Path(tmp)))


def passes(task: Task, reply: str) -> bool:
    """Whether ``reply``'s code, applied to the task's file, passes its hidden tests."""
    code = extract_code(reply, task.metadata.get("entry_point"))
    target = apply_target(task.files)
    if code is None or target is None:
        return False
    with tempfile.TemporaryDirectory(prefix="flywheel-rate-") as tmp:
        write_files(Path(tmp), {**task.files, target: code})
        return grade(task, Path(tmp))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--split", default="train", help="functions split whose templates to measure")
    ap.add_argument("--templates", default=None, help="comma-separated template keys (default: all of --split)")
    ap.add_argument("--variants", type=int, default=2)
    ap.add_argument("--samples", type=int, default=4)
    ap.add_argument("--temperature", type=float, default=0.7)
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-seconds", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=None)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(args.threads)
    path = converted_base_dir()
    tok = AutoTokenizer.from_pretrained(path)
    tok.padding_side = "left"
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    chat = ChatML(tok)
    by_template: dict[str, list[Task]] = {}
    for task in functions.load(args.split):
        by_template.setdefault(task.metadata["template"], []).append(task)
    keys = args.templates.split(",") if args.templates else list(by_template)
    counts: dict[str, list[int]] = {}
    started = time.perf_counter()
    for key in keys:
        tasks = by_template[key][: args.variants]
        prompts = [first_prompt(chat, t) for t in tasks]
        width = max(len(p) for p in prompts)
        ids = torch.tensor([[tok.pad_token_id or 0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                do_sample=True,
                temperature=args.temperature,
                top_p=1.0,
                max_new_tokens=args.max_new_tokens,
                num_return_sequences=args.samples,
                pad_token_id=tok.pad_token_id or 0,
            )
        replies = [chat.decode_reply(row.tolist()) for row in out[:, width:]]
        passed = sum(passes(tasks[i // args.samples], r) for i, r in enumerate(replies))
        counts[key] = [len(replies), passed]
        print(f"{key:<24} {passed}/{len(replies)}", file=sys.stderr, flush=True)
        if args.out:  # after every template: a run stopped from outside keeps what it measured
            args.out.write_text(json.dumps(_result(args, counts, keys, started), indent=1) + "\n")
        if time.perf_counter() - started > args.max_seconds:
            break
    result = _result(args, counts, keys, started)
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    print(json.dumps(result))


def _result(
    args: argparse.Namespace, counts: dict[str, list[int]], keys: list[str], started: float
) -> dict[str, object]:
    """The JSON of a run so far."""
    n, c = sum(v[0] for v in counts.values()), sum(v[1] for v in counts.values())
    return {
        "bench": "template_base_rate",
        "model": "SmolLM2-135M-Instruct (fp32, CPU, first harness turn)",
        "split": args.split,
        "temperature": args.temperature,
        "max_new_tokens": args.max_new_tokens,
        "variants": args.variants,
        "samples": args.samples,
        "templates": counts,
        "pass_rate": round(c / n, 4) if n else None,
        "complete": len(counts) == len(keys),
        "seconds": round(time.perf_counter() - started, 1),
    }


if __name__ == "__main__":
    main()

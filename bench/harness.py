"""The product harness vs a plain chat prompt: pass@1 on the same in-reach tasks, same engine.

Baseline ("plain chat"): one user turn, no system prompt of ours (the model's chat template adds
its default one): the developer's request, the stub of ``solution.py`` in a python code block, and
"Reply with the complete function in one python code block."; the first code block that defines
the entry point is written to ``solution.py`` (``evals.harness.apply.extract_code``) and graded.

Ours: ``evals.harness.agent.run_agent_session`` with the product's system prompt and formats and
the ``functions`` suite's budget (``evals/suites/functions.toml``), graded by ``grade`` (hidden
tests in the sandbox). Sessions run in threads; a lockstep wrapper gathers the turn that every
live session is waiting on into one ``generate`` call of the in-process reference engine
(``serving.reference_engine``, one prompt at a time: the same turns in the same order either way).

Both sides decode the same tasks with the same engine and sampling (greedy by default; with
``--temperature`` > 0, ``--samples`` seeded samples per task, pass@1 = mean over samples). Default:
the real SmolLM2-135M-Instruct on 48 held-out ``functions`` tasks (``--split test``); ``--quick``:
16 tasks. Ends with ONE JSON line: ours = harness pass@1, baseline = plain-chat pass@1, target 1.0
(ratio), pass = ours >= baseline; Wilson 95 % intervals and per-difficulty counts are extra keys.

Flags: ``--quick`` (16 tasks), ``--tasks N`` (a seeded subset), ``--source`` and ``--split`` (the
task source and split; ``functions``, ``test``), ``--suite`` (whose budget the harness side uses),
``--temperature T``, ``--samples N``, ``--model-dir DIR``, ``--threads N``, ``--seed N``. Measured
results and time budgets: ``docs/benchmarks.md``; pass rates: ``docs/tasks.md``.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch

from app.checkpoints.publish import converted_base_dir
from app.core.intervals import wilson_interval as wilson
from app.inference.engine import SamplingParams
from evals.config import load_suite
from evals.harness.agent import AgentBudget, grade, run_agent_session
from evals.harness.apply import extract_code
from evals.harness.chat import ChatML
from evals.harness.workspace import write_files
from evals.tasks import load_tasks
from serving.reference_engine import ReferenceEngine

PLAIN_SUFFIX = "Reply with the complete function in one python code block."


class LockstepEngine:
    """Batches the single-prompt ``generate`` calls of concurrent sessions into one engine call.

    A call waits until every live session (``live`` counts them; :meth:`done` retires one) is
    waiting, then the first caller runs all waiting prompts in one ``engine.generate`` per
    distinct ``SamplingParams`` (seed ignored for grouping; the group's first seed is used).
    """

    def __init__(self, engine, live: int) -> None:
        self.engine, self.tokenizer, self.checkpoint_id = engine, engine.tokenizer, engine.checkpoint_id
        self.eos_token_ids = engine.eos_token_ids
        self._cv = threading.Condition()
        self._live = live
        self._waiting: list[dict] = []

    def done(self) -> None:
        """A session ended: the rest need not wait for it."""
        with self._cv:
            self._live -= 1
            self._maybe_run()

    def generate(self, prompts, params):
        slot = {"prompts": prompts, "params": params, "out": None}
        with self._cv:
            self._waiting.append(slot)
            self._maybe_run()
            while slot["out"] is None:
                self._cv.wait()
        if isinstance(slot["out"], BaseException):
            raise slot["out"]
        return slot["out"]

    def _maybe_run(self) -> None:
        if not self._waiting or len(self._waiting) < self._live:
            return
        batch, self._waiting = self._waiting, []
        groups: dict = {}
        for slot in batch:
            groups.setdefault(replace(slot["params"], seed=None), []).append(slot)
        for slots in groups.values():
            prompts = [p for s in slots for p in s["prompts"]]
            try:
                gens = self.engine.generate(prompts, slots[0]["params"])
            except BaseException as exc:  # handed to the waiting sessions, which raise it
                for s in slots:
                    s["out"] = exc
                continue
            i = 0
            for s in slots:
                s["out"], i = gens[i : i + len(s["prompts"])], i + len(s["prompts"])
        self._cv.notify_all()


def plain_prompt(tokenizer, task) -> list[int]:
    """Token ids of the baseline's one user turn (the model's own chat template)."""
    stub = task.files["solution.py"].rstrip()
    text = f"{task.request}\n\n```python\n{stub}\n```\n\n{PLAIN_SUFFIX}"
    rendered = tokenizer.apply_chat_template(
        [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
    )
    return list(tokenizer(rendered, add_special_tokens=False).input_ids)


def run_plain(engine, tasks, sampling, samples: int, work: Path) -> list[list[bool]]:
    """Baseline: one batched generate per sample index; ``[task][sample]`` pass flags."""
    prompts = [plain_prompt(engine.tokenizer, t) for t in tasks]
    out = [[False] * samples for _ in tasks]
    for s in range(samples):
        params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 1000 * s)
        gens = engine.generate(prompts, params)
        for i, (task, gen) in enumerate(zip(tasks, gens)):
            reply = engine.tokenizer.decode(gen.token_ids, skip_special_tokens=True)
            code = extract_code(reply, task.metadata.get("entry_point"))
            repo = work / f"plain-{i}-{s}"
            write_files(repo, {**task.files, **({"solution.py": code} if code else {})})
            out[i][s] = code is not None and grade(task, repo)
    return out


def run_harness(engine, tasks, budget, sampling, samples: int, work: Path) -> tuple[list[list[bool]], dict]:
    """Ours: every (task, sample) session concurrently through the lockstep batcher."""
    jobs = [(i, s) for s in range(samples) for i in range(len(tasks))]
    lock = LockstepEngine(engine, live=len(jobs))
    out = [[False] * samples for _ in tasks]
    stats = {"turns": 0, "tool_calls": 0, "invalid_tool_calls": 0, "applied": 0, "completion_tokens": 0}

    def one(job):
        i, s = job
        try:
            params = replace(sampling, seed=None if sampling.seed is None else sampling.seed + 1000 * s)
            repo = work / f"ours-{i}-{s}"
            res = run_agent_session(lock, tasks[i], repo, budget, params, session_id=f"bench-{i}-{s}", user_id="bench")
        finally:
            lock.done()
        out[i][s] = grade(tasks[i], repo)
        return res

    with ThreadPoolExecutor(max_workers=len(jobs)) as pool:
        for res in pool.map(one, jobs):
            stats["turns"] += res.turns
            stats["tool_calls"] += res.tool_calls
            stats["invalid_tool_calls"] += res.tool_call_errors
            stats["applied"] += sum(1 for e in res.edits if e.get("applied"))
            stats["completion_tokens"] += res.completion_tokens
    return out, {k: v / len(jobs) for k, v in stats.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="16 tasks instead of 48")
    parser.add_argument("--tasks", type=int, default=None, help="number of tasks (seeded subset)")
    parser.add_argument("--source", default="functions")
    parser.add_argument("--split", default="test")
    parser.add_argument("--suite", default="functions", help="suite whose budget the harness side uses")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--samples", type=int, default=1, help="samples per task (use with --temperature)")
    parser.add_argument("--model-dir", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.model_dir is None:
        model_dir = converted_base_dir()
    else:
        model_dir = Path(args.model_dir)
    n = args.tasks or (16 if args.quick else 48)
    tasks = load_tasks(args.source, args.split, limit=n, seed=args.seed)
    suite = load_suite(args.suite)
    b = suite.budget
    budget = AgentBudget(
        max_turns=b.max_turns,
        max_completion_tokens=b.max_completion_tokens,
        context_tokens=b.context_tokens,
        max_tokens_per_turn=b.max_tokens_per_turn,
    )
    samples = max(1, args.samples if args.temperature > 0 else 1)
    sampling = SamplingParams(max_tokens=b.max_tokens_per_turn, temperature=args.temperature, top_p=1.0, seed=args.seed)
    engine = ReferenceEngine(model_dir, checkpoint_id="base")
    work = Path(tempfile.mkdtemp(prefix="flywheel-bench-harness-"))
    try:
        t0 = time.perf_counter()
        plain = run_plain(engine, tasks, sampling, samples, work)
        t1 = time.perf_counter()
        print(f"plain chat: {sum(map(sum, plain))} passed in {t1 - t0:.0f} s", file=sys.stderr, flush=True)
        ours, stats = run_harness(engine, tasks, budget, sampling, samples, work)
        t2 = time.perf_counter()
    finally:
        shutil.rmtree(work, ignore_errors=True)

    def rate(flags):
        k, m = sum(map(sum, flags)), sum(map(len, flags))
        return k, m, k / m

    ko, m, ours_rate = rate(ours)
    kb, _, base_rate = rate(plain)
    by_level = {}
    for level in sorted({t.metadata.get("difficulty") for t in tasks}):
        idx = [i for i, t in enumerate(tasks) if t.metadata.get("difficulty") == level]
        by_level[str(level)] = {
            "n": len(idx) * samples,
            "ours": sum(sum(ours[i]) for i in idx),
            "baseline": sum(sum(plain[i]) for i in idx),
        }
    print(
        json.dumps(
            {
                "bench": "harness",
                "ours": round(ours_rate, 4),
                "baseline": round(base_rate, 4),
                "unit": "pass@1",
                "ratio": round(ours_rate / base_rate, 3) if base_rate else None,
                "target": 1.0,
                "pass": ours_rate >= base_rate,
                "ours_ci95": [round(x, 3) for x in wilson(ko, m)],
                "baseline_ci95": [round(x, 3) for x in wilson(kb, m)],
                "passed": {"ours": ko, "baseline": kb, "of": m},
                "by_difficulty": by_level,
                "tasks": len(tasks),
                "samples": samples,
                "temperature": args.temperature,
                "source": args.source,
                "split": args.split,
                "harness_per_session": {k: round(v, 2) for k, v in stats.items()},
                "system_prompt_tokens": len(
                    engine.tokenizer(ChatML(engine.tokenizer).system_prompt, add_special_tokens=False).input_ids
                ),
                "seconds": {"baseline": round(t1 - t0, 1), "ours": round(t2 - t1, 1)},
            }
        )
    )


if __name__ == "__main__":
    main()

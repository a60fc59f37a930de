"""Generation throughput of the serving engines side by side, at 64 concurrent requests: vLLM in the
dtype the demo serves in, vLLM fp32, and plain ``model.generate`` (the home-made torch engine this
bench also measured until round 5 is gone; its last figures are in ``docs/benchmarks.md``).

Workload: 2N chat requests at concurrency N (``--quick``: N) (a question, one in four after a code
snippet: 40-110 prompt tokens), greedy, each with its own ``max_tokens`` drawn uniformly
(``--quick``: 32-96, else 32-256; EOS ends a completion early): generation-heavy, as code
completions are. Throughput = completion tokens (up to and including EOS or the request's limit) /
wall seconds, prefill included.

* ``vllm-<dtype>``: a managed vLLM server (:mod:`serving.vllm_server`, the flags the stack runs, one
  server at a time, started before its clock starts), N client threads through
  :class:`serving.openai_engine.OpenAICompatEngine`, each sending its next request when its last one
  completes (N in flight, as sessions do); the server's start time is reported beside it;
* ``plain-static``: the requests as left-padded fp32 ``generate`` calls of N, each decoding up to its
  batch's largest ``max_tokens`` (tokens past a row's own limit or EOS do not count).

``ours`` = the engine the demo serves with (vLLM in ``resolve_dtype("auto")``: bf16 on CPUs with
bf16 instructions), ``baseline`` = plain static batch fp32, target ratio >= 3. Prints one JSON line
per engine, then ONE summary JSON line with ``"engines": {NAME: tokens_per_s}``.

Flags: ``--quick``, ``--model-dir DIR`` (HF folder; default SmolLM2-135M-Instruct),
``--concurrency N`` (64), ``--engines a,b`` (subset of vllm-bf16, vllm-fp32, plain-static),
``--threads N`` (torch threads of the in-process sides; 2). Measured results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import random
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from app.checkpoints.publish import converted_base_dir
from app.core.settings import ServingSettings
from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_command import resolve_dtype
from serving.vllm_server import start_server, stop_server

QUESTIONS = [
    "Write a Python function that reverses a string.",
    "What does the pandas groupby method do?",
    "Explain list comprehensions in one paragraph.",
    "How do I read a CSV file with pandas?",
    "Write a function that checks whether a number is prime.",
    "What is the difference between a list and a tuple?",
    "How can I merge two dictionaries in Python?",
    "Write a unit test for a function add(a, b).",
]
SNIPPET = (
    "def moving_average(values, window):\n    out = []\n    for i in range(len(values) - window + 1):\n"
    "        out.append(sum(values[i:i + window]) / window)\n    return out\n\n"
)
LEVELS = (1, 8, 32, 64)


def build_workload(tok, n: int, lengths: tuple[int, int], seed: int) -> list[tuple[list[int], int]]:
    """``n`` (prompt token ids, max_tokens) pairs with mixed lengths (deterministic for ``seed``)."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        text = SNIPPET * (rng.random() < 0.25) + rng.choice(QUESTIONS)
        ids = tok(
            tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False),
            add_special_tokens=False,
        ).input_ids
        out.append((ids, rng.randint(*lengths)))
    return out


ENGINES = ("vllm-bf16", "vllm-fp32", "plain-static")


def run_clients(generate, work: list[tuple[list[int], int]], concurrency: int) -> tuple[int, float]:
    """(completion tokens, wall seconds) of ``work`` sent by ``concurrency`` client threads."""
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        n = sum(pool.map(generate, work))
    return n, time.perf_counter() - t0


def measure_vllm(dtype: str, model_dir: Path, work, concurrency: int) -> dict:
    """Start a vLLM server in ``dtype``, warm it, run ``work`` through it; stop it."""
    home = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    settings = ServingSettings(vllm_dtype=dtype)
    t0 = time.perf_counter()
    server = start_server("production", model_dir, "bench", home, settings=settings)
    start_s = time.perf_counter() - t0
    try:
        engine = OpenAICompatEngine(server.url)

        def generate(item):
            return len(engine.generate([item[0]], SamplingParams(max_tokens=item[1], temperature=0.0))[0].token_ids)

        run_clients(generate, work[:8], 8)  # warm-up: first requests pay one-off costs
        n, s = run_clients(generate, work, concurrency)
        engine.close()
    finally:
        stop_server("production", home)
    return {
        "tokens_per_s": round(n / s, 2),
        "completion_tokens": n,
        "seconds": round(s, 2),
        "start_s": round(start_s, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="N requests of 32-96 tokens (else 2N of 32-256)")
    parser.add_argument("--model-dir", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--engines", default=",".join(ENGINES), help=f"subset of {','.join(ENGINES)}")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    if args.model_dir is None:
        model_dir = converted_base_dir()
    else:
        model_dir = Path(args.model_dir)
    engines = [e for e in args.engines.split(",") if e]
    unknown = set(engines) - set(ENGINES)
    if unknown:
        parser.error(f"unknown engines {sorted(unknown)}")
    level = args.concurrency
    lengths = (32, 96) if args.quick else (32, 256)
    tok = AutoTokenizer.from_pretrained(model_dir)
    work = build_workload(tok, level if args.quick else 2 * level, lengths, seed=level * 10)
    demo_dtype = resolve_dtype("auto")
    results: dict[str, dict] = {}

    for name in engines:
        if name.startswith("vllm-"):
            dtype = {"vllm-bf16": "bfloat16", "vllm-fp32": "float32"}[name]
            results[name] = measure_vllm(dtype, model_dir, work, level)
        else:
            results[name] = measure_plain(model_dir, work, level)
        print(json.dumps({"engine": name, **results[name]}), flush=True)

    rates = {k: v["tokens_per_s"] for k, v in results.items()}
    ours_name = "vllm-bf16" if demo_dtype == "bfloat16" else "vllm-fp32"
    ours, baseline = rates.get(ours_name), rates.get("plain-static")
    ratio = round(ours / baseline, 2) if ours and baseline else None
    print(
        json.dumps(
            {
                "bench": "generate",
                "ours": ours,
                "baseline": baseline,
                "unit": "tokens/s",
                "ratio": ratio,
                "target": 3,
                "pass": ratio is not None and ratio >= 3,
                "ours_engine": ours_name,
                "baseline_engine": "plain-static (fp32)",
                "engines": rates,
                "concurrency": level,
                "requests": len(work),
                "completion_tokens": list(lengths),
                "details": results,
            }
        )
    )


def measure_plain(model_dir: Path, work, concurrency: int) -> dict:
    """Plain fp32 ``model.generate`` on left-padded static batches of ``concurrency``."""
    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    gen_eos = model.generation_config.eos_token_id
    eos = {tok.eos_token_id, *([gen_eos] if isinstance(gen_eos, int) else gen_eos or [])}
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id

    def count(row: list[int], limit: int) -> int:
        row = row[:limit]
        return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))

    @torch.inference_mode()
    def batch(items):
        width = max(len(p) for p, _ in items)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in items])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in items])
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(m for _, m in items),
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=list(eos),
        )
        return sum(count(row, m) for row, (_, m) in zip(out[:, width:].tolist(), items))

    batch(work[:1])
    n, t0 = 0, time.perf_counter()
    for i in range(0, len(work), concurrency):
        n += batch(work[i : i + concurrency])
    s = time.perf_counter() - t0
    return {"tokens_per_s": round(n / s, 2), "completion_tokens": n, "seconds": round(s, 2)}


if __name__ == "__main__":
    main()

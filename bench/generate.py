"""Generation throughput: the continuously batched torch engine vs plain ``model.generate`` and a
hardware limit, at 1, 8, 32 and 64 concurrent sequences with mixed prompt and completion lengths.

Workload per level N: 2N chat requests (``--quick``: N) (a question, one in four after a code
snippet: 40-110 prompt tokens), greedy, each with its own ``max_tokens`` drawn uniformly
(``--quick``: 32-96, else 32-256; EOS ends a completion early): generation-heavy, as code
completions are, since prefill (no batching gain) would otherwise dominate every side alike.
Throughput = completion tokens (up to and including EOS or the request's limit) / wall seconds,
prefill included.

* ours: N client threads, each sending its next request when its last one completes (N in
  flight, as sessions do), through ``TorchEngine.generate``; the prefix cache is emptied before
  each run so no prompt reuses another's K/V (all share the chat template's system prompt);
* plain generate, batch 1: ``model.generate`` on one request at a time (a few requests);
* plain generate, static batch N: the requests as left-padded ``generate`` calls of N,
  each decoding up to its batch's largest ``max_tokens`` (tokens past a row's own limit or EOS
  do not count);
* limit (at 64): ``C / max(ceil(C / 64) * W / BW, 2 * P * T / G)`` with ``C`` completion tokens,
  ``W`` weight bytes (fp32), ``BW`` measured memory copy bandwidth (bytes/s; each decode step of
  64 sequences reads the weights once), ``P`` parameters in matrix products (all but the input
  embedding; a tied LM head counts), ``T`` prompt + completion tokens, ``G`` measured fp32 GEMM
  rate (FLOP/s, 1024x1024 matmul). Attention FLOPs are left out, so the limit is optimistic.

Targets at 64: ours >= 10x plain batch 1, >= 1.5x plain static batch 64, >= 0.5 of the limit.
Prints one JSON line per level, then ONE summary JSON line; ``ratio`` = ours at 64 / plain batch
1; ``pass`` = all three targets.

Flags: ``--quick`` (N requests per level of N, completions of 32-96 tokens), ``--model-dir DIR`` (HF
folder; default SmolLM2-135M-Instruct), ``--repeats N`` (runs per level, the best kept; default 1),
``--threads N`` (2). Measured results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from concurrent.futures import ThreadPoolExecutor

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


def measure_limits(model) -> dict:
    """fp32 GEMM rate (FLOP/s), memory copy bandwidth (bytes/s), weight bytes and matmul params."""
    import torch

    a, b = torch.randn(1024, 1024), torch.randn(1024, 1024)
    a @ b
    rates = []
    for _ in range(5):
        t0 = time.perf_counter()
        a @ b
        rates.append(2 * 1024**3 / (time.perf_counter() - t0))
    src = torch.randn(64 * 2**20 // 4)
    dst = torch.empty_like(src)
    bws = []
    for _ in range(5):
        t0 = time.perf_counter()
        dst.copy_(src)
        bws.append(2 * src.numel() * 4 / (time.perf_counter() - t0))  # read + write
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.get_input_embeddings().weight.numel()
    tied = model.get_output_embeddings().weight is model.get_input_embeddings().weight
    matmul_params = sum(p.numel() for p in model.parameters() if p.dim() == 2) - (0 if tied else embed)
    return {
        "gemm_flop_s": max(rates),
        "copy_bytes_s": max(bws),
        "weight_bytes": weight_bytes,
        "matmul_params": matmul_params,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="N requests per level of N, completions of 32-96 tokens (else 2N, 32-256)"
    )
    parser.add_argument("--model-dir", default=None, help="HF folder (default: SmolLM2-135M-Instruct)")
    parser.add_argument("--repeats", type=int, default=None, help="runs per level (best kept; default 1)")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()

    import torch

    from app.inference.engine import SamplingParams
    from serving.torch_engine import TorchEngine

    torch.set_num_threads(args.threads)
    if args.model_dir is None:
        from app.checkpoints.publish import converted_base_dir

        model_dir = converted_base_dir()
    else:
        model_dir = args.model_dir
    lengths = (32, 96) if args.quick else (32, 256)
    waves = 1 if args.quick else 2
    repeats = args.repeats or 1

    engine = TorchEngine(model_dir, checkpoint_id="bench", max_seqs=max(LEVELS), max_kv_tokens=64 * 512)
    tok, model = engine.tokenizer, engine.model
    eos = set(engine.eos_token_ids)
    pad = tok.pad_token_id if tok.pad_token_id is not None else engine.eos_token_ids[0]

    def count(row: list[int], limit: int) -> int:
        row = row[:limit]
        return next((i + 1 for i, t in enumerate(row) if t in eos), len(row))

    def ours(work, level):
        engine._scheduler.prefix_cache.clear()

        def client(item):
            return len(engine.generate([item[0]], SamplingParams(max_tokens=item[1], temperature=0.0))[0].token_ids)

        t0 = time.perf_counter()
        with ThreadPoolExecutor(max_workers=level) as pool:
            n = sum(pool.map(client, work))
        return n, time.perf_counter() - t0

    @torch.inference_mode()
    def plain(work):
        width = max(len(p) for p, _ in work)
        ids = torch.tensor([[pad] * (width - len(p)) + p for p, _ in work])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p, _ in work])
        t0 = time.perf_counter()
        out = model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max(m for _, m in work),
            do_sample=False,
            pad_token_id=pad,
            eos_token_id=list(eos),
        )
        elapsed = time.perf_counter() - t0
        return sum(count(row, m) for row, (_, m) in zip(out[:, width:].tolist(), work)), elapsed

    def plain_batches(work, level):
        n = s = 0.0
        for i in range(0, len(work), level):
            dn, ds = plain(work[i : i + level])
            n, s = n + dn, s + ds
        return n, s

    warm = build_workload(tok, 2, (4, 4), seed=99)
    ours(warm, 2)
    plain(warm[:1])
    limits = measure_limits(model)
    details: dict = {
        "limits": {k: round(v / 1e9, 2) if k != "matmul_params" else v for k, v in limits.items()},
        "engine_decode_s_per_token": round(engine.decode_s_per_token, 4),
        "engine_prefill_s_per_token": round(engine.prefill_s_per_token, 5),
    }
    base1 = []
    for r in range(repeats):
        n, s = plain_batches(build_workload(tok, 3, lengths, seed=1000 + r), 1)
        base1.append(n / s)
    details["plain_bs1_tok_s"] = round(max(base1), 2)
    for level in LEVELS:
        rates: dict[str, list[float]] = {"ours": [], "plain": []}
        for r in range(repeats):
            work = build_workload(tok, waves * level, lengths, seed=level * 10 + r)
            sides = (("ours", lambda w: ours(w, level)), ("plain", lambda w: plain_batches(w, level)))  # noqa: B023
            for name, fn in sides if r % 2 == 0 else sides[::-1]:
                n, s = fn(work)
                rates[name].append(n / s)
            if level == max(LEVELS):
                total = sum(len(p) for p, _ in work) + n
                t_min = max(
                    math.ceil(n / level) * limits["weight_bytes"] / limits["copy_bytes_s"],
                    2 * limits["matmul_params"] * total / limits["gemm_flop_s"],
                )
                rates.setdefault("limit", []).append(n / t_min)
        details[f"c{level}"] = {k: round(max(v), 2) for k, v in rates.items()}
        print(json.dumps({"level": level, **details[f"c{level}"]}), flush=True)
    top = details[f"c{max(LEVELS)}"]
    vs_bs1 = top["ours"] / details["plain_bs1_tok_s"]
    vs_static = top["ours"] / top["plain"]
    vs_limit = top["ours"] / top["limit"]
    details["targets"] = {
        "vs_plain_bs1": [round(vs_bs1, 2), 10],
        "vs_plain_static": [round(vs_static, 2), 1.5],
        "vs_limit": [round(vs_limit, 3), 0.5],
    }
    engine.close()
    print(
        json.dumps(
            {
                "bench": "generate",
                "ours": top["ours"],
                "baseline": details["plain_bs1_tok_s"],
                "unit": "tokens/s",
                "ratio": round(vs_bs1, 2),
                "target": 10,
                "pass": vs_bs1 >= 10 and vs_static >= 1.5 and vs_limit >= 0.5,
                "completion_tokens": list(lengths),
                "details": details,
            }
        )
    )


if __name__ == "__main__":
    main()

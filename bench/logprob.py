"""Peak memory and time of the chunked log-prob path next to the naive one, forward + backward.

*Ours* is the path the trainer takes on the CPU, :func:`kernels.logprob_loss.chunked_logprob_loss`
(token chunks, gradients formed while each chunk's logits are in memory: three matmuls per chunk;
log-probs AND entropies). A second column shows :func:`kernels.chunked_logprobs` with plain
autograd (backward recomputes each chunk's logits: four matmuls). The *baseline* is the textbook
``log_softmax(hidden @ W^T).gather(targets)`` (:func:`kernels.reference.naive_logprobs` without the
entropy: log-probs only, so it does strictly less work). All
run forward and backward of ``sum(logprobs * g)`` w.r.t. hidden states and the LM head at
SmolLM2's shape (vocab 49,152, hidden 576) on 4,096 tokens, fp32.

Each variant runs in its own subprocess (with glibc's mmap threshold pinned so freed buffers leave
the RSS at once); peak memory is the growth of peak RSS over the RSS after the inputs were built
(``resource.getrusage`` high-water mark), time is the best wall-clock of the runs (process CPU
time is reported too: on a shared machine it is the steadier of the two). liger-kernel's fused
linear cross entropy is a third column when it is installed and runs on this device (it needs a
GPU, or the ~800x slower Triton interpreter: skipped on CPU).

Ends with one JSON line: ours/baseline peak memory (target <= 0.25); ``pass`` also requires the
wall-clock and CPU time ratios (in the detail) to be <= 1.2.

Flags: ``--quick`` (one round instead of three), ``--n`` (tokens; 4,096), ``--v`` (vocabulary;
49,152), ``--h`` (hidden size; 576), ``--reps N`` (timed runs per subprocess; 1), ``--rounds N``
(alternating rounds of all variants; 3), ``--chunk N`` (tokens per chunk of the chunked paths; 1,024),
``--threads N`` (2).
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import resource
import subprocess
import sys
import time

import psutil
import torch

from kernels import chunked_logprobs
from kernels.logprob_loss import chunked_logprob_loss
from kernels.reference import naive_logprobs

MEM_TARGET = 0.25
TIME_TARGET = 1.2


def worker(variant: str, n: int, v: int, h: int, reps: int, chunk: int, threads: int) -> dict:
    """Run one variant in this process; returns ``{"peak_mb", "seconds"}``."""
    torch.set_num_threads(threads)
    g = torch.Generator().manual_seed(0)
    hidden = (torch.randn(n, h, generator=g) * 0.5).requires_grad_()
    weight = (torch.randn(v, h, generator=g) * 0.05).requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    upstream = torch.randn(n, generator=g)

    if variant == "naive":

        def run():
            return naive_logprobs(hidden, weight, targets, entropy=False)[0]
    elif variant == "chunked":

        def run():
            return chunked_logprobs(hidden, weight, targets, chunk_size=chunk, backend="torch")[0]
    elif variant == "fused":

        def loss():
            return chunked_logprob_loss(
                hidden, weight, targets, lambda lp, sl: (lp * upstream[sl]).sum(), chunk_size=chunk, backend="torch"
            )[0]
    elif variant == "liger":
        from liger_kernel.ops.fused_linear_cross_entropy import LigerFusedLinearCrossEntropyFunction

        def run():
            loss = LigerFusedLinearCrossEntropyFunction.apply(
                hidden, weight, targets, None, None, -100, 0.0, 0.0, "none"
            )
            return -(loss[0] if isinstance(loss, tuple) else loss)
    else:
        raise SystemExit(f"unknown variant {variant}")

    gc.collect()
    base_rss = psutil.Process().memory_info().rss
    best = best_cpu = float("inf")
    for _ in range(reps):
        hidden.grad = weight.grad = None
        start, start_cpu = time.perf_counter(), time.process_time()
        (loss() if variant == "fused" else (run() * upstream).sum()).backward()
        best = min(best, time.perf_counter() - start)
        best_cpu = min(best_cpu, time.process_time() - start_cpu)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    return {"peak_mb": max(0, peak - base_rss) / 2**20, "seconds": best, "cpu_seconds": best_cpu}


def run_variant(variant: str, args) -> dict:
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "131072", "MALLOC_TRIM_THRESHOLD_": "131072"}
    cmd = [
        sys.executable,
        __file__,
        "--worker",
        variant,
        "--n",
        str(args.n),
        "--v",
        str(args.v),
        "--h",
        str(args.h),
        "--reps",
        str(args.reps),
        "--chunk",
        str(args.chunk),
        "--threads",
        str(args.threads),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"error": (proc.stderr.strip().splitlines() or ["failed"])[-1]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def liger_available() -> str | None:
    """None when liger-kernel can run here, else the reason it is skipped."""
    try:
        if importlib.util.find_spec("liger_kernel") is None:
            return "liger-kernel not installed"
        if not torch.cuda.is_available():
            return "liger-kernel needs a GPU (CPU only under the Triton interpreter, ~800x slower)"
    except Exception as exc:  # noqa: BLE001 - a bench reports why a column is missing
        return str(exc)
    return None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one round instead of three (about a minute)")
    p.add_argument("--n", type=int, default=4096, help="tokens")
    p.add_argument("--v", type=int, default=49_152, help="vocabulary")
    p.add_argument("--h", type=int, default=576, help="hidden size")
    p.add_argument("--reps", type=int, default=1, help="timed runs per subprocess")
    p.add_argument("--rounds", type=int, default=3, help="alternating rounds of all variants")
    p.add_argument("--chunk", type=int, default=1024, help="tokens per chunk of the chunked paths")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--worker", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        print(json.dumps(worker(args.worker, args.n, args.v, args.h, args.reps, args.chunk, args.threads)))
        return
    if args.quick:  # same shape (the memory target is defined at 4,096 tokens), one round
        args.rounds = 1

    # Rounds alternate the variants so a busy neighbour slows them alike; best time, worst memory.
    results: dict[str, dict] = {}
    for _ in range(args.rounds):
        for name in ("naive", "chunked", "fused"):
            r = run_variant(name, args)
            prev = results.get(name)
            if "error" in r or prev is None or "error" in prev:
                results[name] = r if prev is None or "error" in r else prev
                continue
            results[name] = {
                "peak_mb": max(prev["peak_mb"], r["peak_mb"]),
                "seconds": min(prev["seconds"], r["seconds"]),
                "cpu_seconds": min(prev["cpu_seconds"], r["cpu_seconds"]),
            }
    skip = liger_available()
    results["liger_flce"] = {"skipped": skip} if skip else run_variant("liger", args)
    print(f"log-probs fwd+bwd, N={args.n} V={args.v} H={args.h} fp32, {args.threads} threads, chunk {args.chunk}")
    print(f"{'variant':<12}{'peak MB':>12}{'wall s':>12}{'cpu s':>12}")
    for name, r in results.items():
        if r and "peak_mb" in r:
            print(f"{name:<12}{r['peak_mb']:>12.0f}{r['seconds']:>12.3f}{r['cpu_seconds']:>12.3f}")
        else:
            print(f"{name:<12}  {r}")
    ours, base = results["fused"], results["naive"]
    if "peak_mb" not in ours or "peak_mb" not in base:
        print(
            json.dumps(
                {
                    "bench": "logprob",
                    "ours": None,
                    "baseline": None,
                    "unit": "MB peak",
                    "ratio": None,
                    "target": MEM_TARGET,
                    "pass": False,
                    "detail": results,
                }
            )
        )
        return
    mem_ratio = ours["peak_mb"] / max(base["peak_mb"], 1e-9)
    time_ratio = ours["seconds"] / base["seconds"]
    cpu_ratio = ours["cpu_seconds"] / base["cpu_seconds"]
    print(
        json.dumps(
            {
                "bench": "logprob",
                "ours": round(ours["peak_mb"], 1),
                "baseline": round(base["peak_mb"], 1),
                "unit": "MB peak (fwd+bwd)",
                "ratio": round(mem_ratio, 3),
                "target": MEM_TARGET,
                "pass": mem_ratio <= MEM_TARGET and time_ratio <= TIME_TARGET and cpu_ratio <= TIME_TARGET,
                "time_s": {"ours": round(ours["seconds"], 3), "baseline": round(base["seconds"], 3)},
                "time_ratio": round(time_ratio, 3),
                "time_target": TIME_TARGET,
                "cpu_time_ratio": round(cpu_ratio, 3),
                "chunked_autograd": results["chunked"],
                "liger_flce": results["liger_flce"],
                "shape": {"tokens": args.n, "vocab": args.v, "hidden": args.h},
                "quick": args.quick,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Trainer throughput: next to a bare forward + backward, on a GPU against its peak, and on N ranks.

Three measurements, chosen by the flags; each ends with one JSON line.

*Step* (default, any device): *ours* is one optimizer step of :func:`trainer.step.train_steps` --
decoder forward, the policy loss fused with the LM head on trainable tokens (:mod:`kernels`),
backward, gradient clipping, AdamW -- over synthetic agent trajectories packed into micro-batches
(gradient accumulation), under the trainer's device policy (:mod:`trainer.device`: on the CPU bf16
autocast where bf16 is measured faster, else fp32; bf16 autocast over fp32 master weights, TF32 and
the Triton kernel on CUDA). The *baseline* is the
bare loop a training script starts from: ``model(input_ids).logits`` for every position,
``log_softmax(...).gather`` of the targets, a mean over the model's tokens, backward -- no
optimizer, no importance weights, same autocast. Both see the very same padded micro-batches;
rounds alternate and the best round counts (the machine is shared). On the CPU the target is
ours / baseline >= 0.8 (``pass`` also requires the same ratio per CPU-second, steadier on a shared
machine). On CUDA the line adds MFU = 6 x params x tokens/s / the GPU's dense bf16 peak (the
6N-FLOPs-per-token rule of Kaplan et al. 2020; attention FLOPs not counted; H100/H200 989 TFLOP/s),
and for ``--shape qwen3-0.6b`` the target is >= 12,000 tokens/s on one H100 (prime-rl's reported
11.9k tokens/s for Qwen3-0.6B RL on one H100).

*Ranks* (``--ranks N``, CPU, gloo): the same cycle (:func:`trainer.training.train_policy`: pi_old pass
and optimizer steps) on 1 process and on N spawned gloo ranks
(:func:`trainer.testing.train_on_ranks`). ``loss_match`` holds when every step's loss and gradient
norm agree within ``rel 1e-4`` (+ ``abs 1e-7``) and every final parameter within ``1e-2 x lr``
absolute (the ranks sum gradients in a different order; AdamW's update is at most about ``lr`` per
step); ``pass`` requires it. Tokens/s of each count the optimizer steps' wall time on rank 0; on a
machine with fewer cores than ranks x threads, N ranks are not faster. ``--fsdp``: the N ranks shard
the model (FSDP2, ``parallel.mode = "fsdp"``, :mod:`trainer.sharding`) instead of replicating it
(DDP). Either way the line carries each rank's ``peak_rss_bytes`` (``ru_maxrss``), the same less the
rank's RSS before it loaded the model (the Python + torch runtime, which no model size changes),
and ``memory_floor_bytes`` (:func:`bench.train_memory.memory_floor`: that rank's share of fp32
weights, gradients and AdamW state + one micro-batch's activations, + under FSDP the largest unit
gathered whole with its gradient); ``pass`` also requires the peak above start <= 1.5 x the floor.

Models have the architecture of ``--shape`` with random weights built from a config (no download;
throughput does not depend on the weights' values): ``smollm2-135m`` (Llama, 30 layers, hidden 576,
vocab 49,152) or ``qwen3-0.6b`` (28 layers, hidden 1,024, vocab 151,936). ``--quick`` uses 4 layers.
Tokens/s counts real (non-padding) tokens.

Flags: ``--quick`` (4 layers, smaller batch, 1 round), ``--shape smollm2-135m|qwen3-0.6b``,
``--layers N``, ``--device auto|cpu|cuda``, ``--ranks N``, ``--trajectories N`` (8), ``--seq-len N``
(256), ``--micro-batch-tokens N`` (1,024), ``--rounds N`` (2), ``--threads N`` (2), ``--peak-tflops X``
(the GPU's dense bf16 peak; default by GPU name). Measured on an H100: ``docs/gpu.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import numpy as np
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen3Config, Qwen3ForCausalLM

from bench.train_memory import fsdp_units, memory_floor
from trainer.batching import group_ids, pack_micro_batches
from trainer.config import TrainerConfig
from trainer.data import Segment
from trainer.device import setup_placement
from trainer.loss import compute_advantages
from trainer.step import compute_old_logprobs, make_optimizer, train_steps
from trainer.testing import make_trajectory, train_on_ranks

CPU_TARGET = 0.8
QWEN3_H100_TARGET = 12_000.0  # tokens/s
PEAK_BF16_TFLOPS = {"H100": 989.0, "H200": 989.0, "A100": 312.0}  # dense, per GPU
RANK_LR = 1e-4
MEMORY_TARGET = 1.5  # peak RSS a rank adds after importing torch, over its analytic floor


def build_model(shape: str, layers: int | None):
    """A random-weight causal LM of ``shape`` with ``layers`` decoder layers (default: the real count)."""
    torch.manual_seed(0)
    if shape == "qwen3-0.6b":
        cfg = Qwen3Config(
            vocab_size=151_936,
            hidden_size=1024,
            intermediate_size=3072,
            num_hidden_layers=layers or 28,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=40_960,
            tie_word_embeddings=True,
            rms_norm_eps=1e-6,
            rope_theta=1_000_000.0,
        )
        return Qwen3ForCausalLM(cfg)
    cfg = LlamaConfig(
        vocab_size=49_152,
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=layers or 30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=8192,
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        rope_theta=100_000.0,
    )
    return LlamaForCausalLM(cfg)


def build_trajectories(n_traj: int, seq_len: int, vocab: int):
    """Synthetic trajectories: alternating prompt/tool and model turns, about half of the tokens
    the model's own (as in agent sessions); two per task."""
    rng = np.random.default_rng(0)
    trajs = []
    for i in range(n_traj):
        ids = rng.integers(3, vocab, size=seq_len).astype(np.int32)
        mask = np.zeros(seq_len, dtype=np.uint8)
        for start in range(seq_len // 8, seq_len, seq_len // 4):
            mask[start : start + seq_len // 8] = 1
        lp = np.where(mask == 1, rng.normal(-2.0, 0.5, seq_len), 0.0).astype(np.float32)
        reward = float(i % 3 == 0) + 0.25 * (i % 2)  # the two of a task always differ: no zero advantage
        trajs.append(make_trajectory([Segment(ids, mask, lp)], reward, task_id=f"t{i // 2}"))
    return trajs


def build_batches(trajs, micro_batch_tokens: int):
    adv = compute_advantages(torch.tensor([t.reward for t in trajs]), group_ids(trajs))
    return pack_micro_batches(trajs, adv, micro_batch_tokens=micro_batch_tokens)


def bare_step(model, batches, placement) -> None:
    model.zero_grad(set_to_none=True)
    for mb in batches:
        with placement.autocast():
            logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, mb.input_ids[:, 1:, None]).squeeze(2)
        mask = torch.zeros_like(logp, dtype=torch.bool).view(-1)
        mask[mb.hidden_index - torch.div(mb.hidden_index, mb.input_ids.shape[1], rounding_mode="floor")] = True
        loss = -(logp.reshape(-1)[mask]).sum() / 4096.0
        loss.backward()


def _timed(fn, placement) -> tuple[float, float]:
    start, cpu = time.perf_counter(), time.process_time()
    fn()
    if placement.is_cuda:
        torch.cuda.synchronize()
    return time.perf_counter() - start, time.process_time() - cpu


def bench_step(args) -> dict:
    placement = setup_placement(args.device)
    torch.set_num_threads(args.threads)
    model = placement.place_model(build_model(args.shape, args.layers))
    vocab = model.config.vocab_size
    batches = [
        placement.move_batch(mb)
        for mb in build_batches(build_trajectories(args.trajectories, args.seq_len, vocab), args.micro_batch_tokens)
    ]
    tokens = sum(mb.num_tokens for mb in batches)
    config = TrainerConfig.model_validate(
        {
            "grad_accum": len(batches),
            "epochs": 1,
            "threads": args.threads,
            "device": args.device,
            "data": {"micro_batch_tokens": args.micro_batch_tokens},
            "optim": {"lr": 1e-6},
        }
    )
    compute_old_logprobs(model, batches, config, placement=placement)
    optimizer = make_optimizer(model, config)
    ours_s, bare_s, ours_cpu, bare_cpu = [], [], [], []
    train_steps(model, batches, config, optimizer, placement=placement)  # warm-up (allocator, AdamW, kernels)
    bare_step(model, batches, placement)
    for _ in range(args.rounds):
        s, c = _timed(lambda: train_steps(model, batches, config, optimizer, placement=placement), placement)
        ours_s.append(s)
        ours_cpu.append(c)
        s, c = _timed(lambda: bare_step(model, batches, placement), placement)
        bare_s.append(s)
        bare_cpu.append(c)
    old_pass_s, _ = _timed(lambda: compute_old_logprobs(model, batches, config, placement=placement), placement)
    ours, bare = tokens / min(ours_s), tokens / min(bare_s)
    cycle = tokens / (min(ours_s) + old_pass_s)
    params = sum(p.numel() for p in model.parameters())  # tied embeddings once
    print(
        f"{args.shape} {model.config.num_hidden_layers} layers ({params / 1e6:.1f}M params) on {placement.device}, "
        f"{len(batches)} micro-batches, {tokens} tokens ({sum(mb.num_trainable for mb in batches)} trainable)"
    )
    print(f"trainer step    {ours:10.1f} tok/s   (best of {[round(s, 3) for s in ours_s]} s)")
    print(f"bare fwd+bwd    {bare:10.1f} tok/s   (best of {[round(s, 3) for s in bare_s]} s)")
    print(f"cycle incl. pi_old pass, 1 epoch: {cycle:.1f} tok/s")
    line = {
        "bench": "train",
        "ours": round(ours, 1),
        "baseline": round(bare, 1),
        "unit": "tokens/s",
        "ratio": round(ours / bare, 3),
        "device": str(placement.device),
        "shape": args.shape,
        "layers": model.config.num_hidden_layers,
        "params": params,
        "tokens": tokens,
        "cycle_tokens_per_s_incl_old_logprob_pass": round(cycle, 1),
        "quick": args.quick,
    }
    if placement.is_cuda:
        name = torch.cuda.get_device_name(placement.device)
        peak = args.peak_tflops or next((v for k, v in PEAK_BF16_TFLOPS.items() if k in name), None)
        mfu = 6 * params * ours / (peak * 1e12) if peak else None
        print(f"{name}: MFU {mfu:.1%} of {peak} TFLOP/s bf16" if mfu else f"{name}: unknown peak (--peak-tflops)")
        target = QWEN3_H100_TARGET if args.shape == "qwen3-0.6b" and not args.quick else None
        line.update(
            {
                "gpu": name,
                "mfu": round(mfu, 4) if mfu else None,
                "peak_tflops": peak,
                "bare_mfu": round(6 * params * bare / (peak * 1e12), 4) if peak else None,
                "target": target,
                "target_unit": "ours tokens/s" if target else None,
                "pass": ours >= target if target else ours / bare >= CPU_TARGET,
            }
        )
    else:
        cpu_ratio = min(bare_cpu) / min(ours_cpu)  # tokens per CPU-second, ours / baseline
        print(f"per CPU-second: ours / bare = {cpu_ratio:.3f}")
        line.update(
            {
                "target": CPU_TARGET,
                "pass": ours / bare >= CPU_TARGET and cpu_ratio >= CPU_TARGET,
                "cpu_ratio": round(cpu_ratio, 3),
            }
        )
    return line


def _steps_tokens_per_s(history: list[dict]) -> float:
    return sum(h["tokens"] for h in history) / max(sum(h["seconds"] for h in history), 1e-9)


def compare_runs(one: dict, many: dict, lr: float) -> dict:
    """Largest disagreements between a 1-rank and an N-rank run and whether they are within tolerance
    (see the module docstring)."""
    steps_ok = len(one["history"]) == len(many["history"])
    worst_rel = 0.0
    for a, b in zip(one["history"], many["history"]):
        for key in ("loss", "grad_norm"):
            diff = abs(a[key] - b[key])
            steps_ok &= diff <= 1e-4 * abs(a[key]) + 1e-7
            worst_rel = max(worst_rel, diff / max(abs(a[key]), 1e-12))
    worst_param = max(float((one["state"][k] - many["state"][k]).abs().max()) for k in one["state"])
    params_ok = worst_param <= 1e-2 * lr and not math.isnan(worst_param)
    return {
        "loss_match": bool(steps_ok and params_ok),
        "max_rel_diff_loss_grad_norm": worst_rel,
        "max_abs_diff_params": worst_param,
        "param_tolerance": 1e-2 * lr,
    }


def bench_ranks(args) -> dict:
    torch.set_num_threads(args.threads)
    model = build_model(args.shape, args.layers)
    trajs = build_trajectories(args.trajectories, args.seq_len, model.config.vocab_size)
    n_batches = len(build_batches(trajs, args.micro_batch_tokens))
    # ranks + 1 micro-batches a step: they do not divide evenly over the ranks (gradients summed in
    # another order than in one process) and an epoch's last step leaves a rank without any
    grad_accum = args.ranks + 1
    settings = {
        "grad_accum": grad_accum,
        "epochs": 2,
        "threads": args.threads,
        "device": "cpu",
        "precision": "fp32",  # the same arithmetic on every host, whatever its bf16 flags
        "data": {"micro_batch_tokens": args.micro_batch_tokens},
        "optim": {"lr": RANK_LR},
    }
    config = TrainerConfig.model_validate(settings)
    sharded = TrainerConfig.model_validate({**settings, "parallel": {"mode": "fsdp" if args.fsdp else "ddp"}})
    params = sum(p.numel() for p in model.parameters())
    floor = memory_floor(
        model.config,
        params=params,
        world=args.ranks,
        sharded=args.fsdp,
        micro_batch_tokens=args.micro_batch_tokens,
        unit_params=fsdp_units(model),
    )
    initial = {k: v.clone() for k, v in model.state_dict().items()}
    with tempfile.TemporaryDirectory(prefix="bench-train-") as tmp:
        model.save_pretrained(Path(tmp) / "policy", safe_serialization=True)
        del model
        one = train_on_ranks(Path(tmp) / "policy", trajs, config, 1, Path(tmp) / "one")
        many = train_on_ranks(Path(tmp) / "policy", trajs, sharded, args.ranks, Path(tmp) / "many")
    match = compare_runs(one, many, RANK_LR)
    moved = max(float((one["state"][k] - initial[k]).abs().max()) for k in one["state"] if k in initial)
    tps_1, tps_n = _steps_tokens_per_s(one["history"]), _steps_tokens_per_s(many["history"])
    print(
        f"{args.shape} {args.layers or 'all'} layers, {n_batches} micro-batches, grad_accum {grad_accum}, "
        f"{len(one['history'])} steps"
    )
    print(
        f"1 rank ({args.threads} threads)  {tps_1:10.1f} tok/s   losses {[round(h['loss'], 6) for h in one['history']]}"
    )
    print(
        f"{args.ranks} gloo ranks (1 thread) {tps_n:10.1f} tok/s   losses {[round(h['loss'], 6) for h in many['history']]}"
    )
    print(
        f"grad norms {[round(h['grad_norm'], 6) for h in one['history']]} vs "
        f"{[round(h['grad_norm'], 6) for h in many['history']]}; training moved a parameter by up to {moved:.2e}"
    )
    print(
        f"max |param diff| {match['max_abs_diff_params']:.2e} (tolerance {match['param_tolerance']:.0e}), "
        f"max rel diff of loss / grad norm {match['max_rel_diff_loss_grad_norm']:.2e} (tolerance 1e-4)"
    )
    peaks = [r["peak_rss_bytes"] for r in many["ranks"]]
    above = [r["peak_rss_bytes"] - r["start_rss_bytes"] for r in many["ranks"]]
    memory_ok = max(above) <= MEMORY_TARGET * floor["total"]
    mode = "FSDP2" if args.fsdp else "DDP"
    print(
        f"{mode} peak RSS per rank {[round(b / 2**20) for b in peaks]} MiB, above each rank's start (torch "
        f"imported) {[round(b / 2**20) for b in above]} MiB; floor {floor['total'] / 2**20:.0f} MiB "
        f"({', '.join(f'{k} {v / 2**20:.0f}' for k, v in floor.items() if k != 'total')}); target <= "
        f"{MEMORY_TARGET} x floor: {'met' if memory_ok else 'missed'}"
    )
    return {
        "bench": "train",
        "ours": round(tps_n, 1),
        "baseline": round(tps_1, 1),
        "unit": "tokens/s",
        "ratio": round(tps_n / tps_1, 3),
        "target": "loss_match and peak RSS above start <= 1.5 x memory floor",
        "pass": match["loss_match"] and memory_ok,
        "ranks": args.ranks,
        "mode": "fsdp" if args.fsdp else "ddp",
        "peak_rss_bytes": peaks,
        "peak_rss_above_start_bytes": above,
        "memory_floor_bytes": floor["total"],
        "memory_floor_parts": {k: v for k, v in floor.items() if k != "total"},
        "peak_over_floor": round(max(above) / floor["total"], 3),
        "tokens_per_s_1_rank": round(tps_1, 1),
        f"tokens_per_s_{args.ranks}_ranks": round(tps_n, 1),
        **match,
        "max_param_change": moved,
        "backend": "gloo",
        "shape": args.shape,
        "layers": args.layers,
        "quick": args.quick,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, smaller batch, 1 round")
    p.add_argument("--shape", choices=("smollm2-135m", "qwen3-0.6b"), default="smollm2-135m")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default: the shape's)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto")
    p.add_argument("--ranks", type=int, default=1, help="> 1: compare the cycle on 1 and on N gloo ranks (CPU)")
    p.add_argument("--fsdp", action="store_true", help="with --ranks: the N ranks shard the model (FSDP2)")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--peak-tflops", type=float, default=None, help="GPU dense bf16 peak (default: by GPU name)")
    args = p.parse_args()
    if args.quick:
        args.layers, args.rounds = 4, 1
        args.trajectories = 8 if args.ranks > 1 else 4
        if args.ranks > 1:
            args.micro_batch_tokens = 512
    line = bench_ranks(args) if args.ranks > 1 else bench_step(args)
    print(json.dumps(line))


if __name__ == "__main__":
    main()

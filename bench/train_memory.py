"""Trainer memory: the analytic floor of one rank, and where a step's memory goes on the real model.

``memory_floor`` is what one rank cannot do without (weights + gradients + AdamW state + one
micro-batch's activations); ``bench/train.py`` reports each rank's peak RSS beside it.

Run as a script (``python bench/train_memory.py [--model DIR]``) it loads the real SmolLM2-135M
(the folder ``flywheel model init`` materializes, ``app.checkpoints.publish.converted_base_dir``) and
prints the process RSS (psutil) after each stage of a cycle's first steps: imports, load, pack,
optimizer, each micro-batch's forward and backward, the optimizer step. Tensor memory is invisible
to ``tracemalloc`` (torch allocates outside Python's allocator), so RSS is the measure; the
Python-object share is printed once from ``tracemalloc`` to show it is small. ``--trim`` also prints
the RSS after glibc's ``malloc_trim(0)`` at each stage: the difference is freed memory the
allocator kept. One JSON line ends it.
"""

from __future__ import annotations

import argparse
import ctypes
import ctypes.util
import gc
import json
import sys
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import numpy as np
import psutil
import torch

from app.checkpoints.publish import converted_base_dir
from trainer.checkpointing import load_policy
from trainer.config import TrainerConfig
from trainer.data import Segment
from trainer.device import setup_placement
from trainer.step import micro_batch_loss, use_behaviour_logprobs
from trainer.testing import make_trajectory
from trainer.training import pack_cycle

GiB = 2**30
LIBC = ctypes.CDLL(ctypes.util.find_library("c"))


def memory_floor(
    config,
    *,
    params: int,
    world: int,
    sharded: bool,
    micro_batch_tokens: int,
    compute_bytes: int = 4,
    chunk: int = 1024,
    unit_params: tuple[int, ...] = (0,),
) -> dict[str, int]:
    """One rank's memory floor in bytes, by part, and their ``total``.

    Args:
        config: the model's Hugging Face config (Llama/Qwen3 fields: hidden_size, intermediate_size,
            num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim, vocab_size).
        params: trainable parameters (tied embeddings once). world: ranks. sharded: FSDP (weights,
            gradients and AdamW state divided by ``world``) or DDP (whole on every rank).
        micro_batch_tokens: padded tokens of one micro-batch. compute_bytes: 2 under bf16, else 4.
        chunk: tokens per chunk of the fused LM head (``logprob_chunk_size``).
        unit_params: parameters of each FSDP unit (each decoder layer; the root: embeddings tied to
            the LM head, final norm); sharded, the largest is gathered whole with its gradient.

    The activation count is ours, per token and decoder layer, of what autograd keeps for backward
    (after Korthikanti et al. 2022, "Reducing Activation Recomputation", section 4.1, for SwiGLU and
    grouped-query attention with a fused attention kernel that keeps no score matrix): the two norms'
    inputs and outputs (4h), q and the attention output (2h), k and v (2 kv), o_proj's input (h),
    the MLP's gate, up, silu(gate) and product (4 I), and the log-sum-exp per head (a). The fused LM
    head holds one chunk's fp32 logits and their gradient (2 x chunk x V x 4 bytes). Sharded, a rank
    also holds the unit it computes on gathered whole, weights and gradient (8 bytes a parameter).
    """
    h, layers = config.hidden_size, config.num_hidden_layers
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or h // heads
    kv = config.num_key_value_heads * head_dim
    per_token_layer = 7 * h + 2 * kv + 4 * config.intermediate_size + heads
    parts = {
        "weights_bytes": 4 * params // (world if sharded else 1),
        "gradients_bytes": 4 * params // (world if sharded else 1),
        "optimizer_bytes": 8 * params // (world if sharded else 1),
        "activations_bytes": micro_batch_tokens * (layers * per_token_layer + 3 * h) * compute_bytes,
        "lm_head_chunk_bytes": 2 * min(chunk, micro_batch_tokens) * config.vocab_size * 4,
    }
    if sharded:  # FSDP computes on one unit gathered whole: its fp32 weights and unsharded gradient
        parts["gathered_unit_bytes"] = 8 * max(unit_params)
    parts["total"] = sum(parts.values())
    return parts


def fsdp_units(model: torch.nn.Module) -> tuple[int, ...]:
    """Parameters of each FSDP unit :mod:`trainer.sharding` makes: every decoder layer, then the root
    (everything else: embeddings tied to the LM head, final norm; tied weights once)."""
    layers = [sum(p.numel() for p in layer.parameters()) for layer in model.get_decoder().layers]
    return (*layers, sum(p.numel() for p in model.parameters()) - sum(layers))


def rss() -> int:
    """This process's resident set size in bytes."""
    return psutil.Process().memory_info().rss


def _trajectories(vocab: int, n: int, seq_len: int):
    """``n`` random trajectories of ``seq_len`` tokens, the second half of each the model's own."""
    rng = np.random.default_rng(0)
    out = []
    for i in range(n):
        ids = rng.integers(3, vocab, size=seq_len).astype(np.int32)
        mask = (np.arange(seq_len) >= seq_len // 2).astype(np.uint8)
        lp = np.where(mask == 1, -2.0, 0.0).astype(np.float32)
        out.append(make_trajectory([Segment(ids, mask, lp)], float(i % 2), task_id=f"t{i // 2}"))
    return out


def stages(model_dir: Path, n: int, seq_len: int, micro_batch_tokens: int, steps: int, trim: bool = False) -> dict:
    """Walk a cycle's first ``steps`` optimizer steps on the real model, printing RSS after each stage
    (with ``trim``, also after glibc's ``malloc_trim(0)``, which returns freed heap pages to the OS)."""
    marks: list[tuple[str, int]] = []
    trimmed: list[tuple[str, int]] = []

    def mark(name: str) -> None:
        gc.collect()
        marks.append((name, rss()))
        line = f"{name:<34} RSS {marks[-1][1] / GiB:6.2f} GiB"
        if trim:  # hand freed heap memory back to the OS: what is left is live (or fragmented in place)
            LIBC.malloc_trim(0)
            trimmed.append((name, rss()))
            line += f"   after malloc_trim {trimmed[-1][1] / GiB:6.2f} GiB"
        print(line, flush=True)

    mark("imports (torch, transformers)")
    config = TrainerConfig.model_validate(
        {
            "grad_accum": 2,
            "epochs": 1,
            "threads": 2,
            "device": "cpu",
            "pi_old": "behaviour",
            "data": {"micro_batch_tokens": micro_batch_tokens},
        }
    )
    placement = setup_placement("cpu", precision=config.precision)
    model = placement.place_model(load_policy(model_dir))
    mark("load fp32 policy")
    trajectories = _trajectories(model.config.vocab_size, n, seq_len)
    *_, batches = pack_cycle(trajectories, config)
    use_behaviour_logprobs(batches)
    mark(f"pack {len(batches)} micro-batches")
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-6)
    model.train()
    tracemalloc.start()
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        for i, mb in enumerate(batches[step * 2 : step * 2 + 2]):
            with placement.autocast():
                loss, _ = micro_batch_loss(model, mb, config)
            mark(f"step {step + 1} mb {i + 1} forward")
            loss.backward()
            del loss
            mark(f"step {step + 1} mb {i + 1} backward")
        optimizer.step()
        mark(f"step {step + 1} AdamW step")
    python_bytes = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    params = sum(p.numel() for p in model.parameters())
    floor = memory_floor(
        model.config,
        params=params,
        world=1,
        sharded=False,
        micro_batch_tokens=micro_batch_tokens,
        compute_bytes=2 if placement.compute_dtype == torch.bfloat16 else 4,
    )
    peak = max(b for _, b in marks)
    return {
        "bench": "train_memory",
        "params": params,
        "precision": placement.describe()["precision"],
        "stages": dict(marks),
        "peak_rss_bytes": peak,
        "peak_above_imports_bytes": peak - marks[0][1],
        "memory_floor_bytes": floor["total"],
        "floor": floor,
        "python_objects_peak_bytes": python_bytes,
        **({"stages_after_malloc_trim": dict(trimmed)} if trim else {}),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", type=Path, default=None, help="HF folder (default: the converted SmolLM2 base)")
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--micro-batch-tokens", type=int, default=2048)
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--trim", action="store_true", help="also RSS after malloc_trim(0) at each stage (glibc)")
    args = p.parse_args()
    torch.set_num_threads(2)
    if args.model is None:
        args.model = converted_base_dir()
    line = stages(args.model, args.trajectories, args.seq_len, args.micro_batch_tokens, args.steps, args.trim)
    print(json.dumps(line))


if __name__ == "__main__":
    main()

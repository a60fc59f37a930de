"""Trainer throughput with a task group's common prompt computed once (``data.share_prefixes``) against whole rows.

Workload: synthetic sessions shaped like a real cycle's (``--quick`` cycle 1 of the functions
tasks: 116 trajectories in 32 groups of 3-4, a group's common prompt 167-227 tokens, the rest of a
row 25-193, one turn): ``--groups`` task groups alternately of 4 and 3 sessions, each group one
prompt of 165-230 tokens, each session a completion of 25-195 tokens.
Model: SmolLM2-135M's architecture with random weights (``bench/train.py``'s ``build_model``; the
weights do not change the cost). Both layouts are packed by :func:`trainer.batching.pack_micro_batches`
at the trainer's default budget (2,048 tokens a micro-batch) and run the trainer's own forward,
policy loss and backward (:func:`trainer.step.micro_batch_loss`) over every micro-batch, in the
precision ``auto`` resolves to on this host; rounds alternate and each layout keeps its best.

*ours* = rows' tokens per second with shared prefixes, *baseline* = the same with whole rows
(tokens counted as the rows hold them in both, so the ratio is the speed-up of a cycle's training).
``loss_match``: the summed loss of the two layouts agrees within ``rel 1e-3``. Target: ratio >= 1.25,
the cut in padded tokens of the real cycle (34,076 -> 26,376); ``pass`` also needs ``loss_match``.

Flags: ``--quick`` (4 layers, 8 groups), ``--groups N`` (16), ``--layers N`` (30),
``--rounds N`` (1), ``--threads N`` (2). Measured results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

from train import build_model  # noqa: E402  (bench/train.py)

from trainer.config import TrainerConfig  # noqa: E402
from trainer.data import Segment  # noqa: E402
from trainer.device import setup_placement  # noqa: E402
from trainer.step import micro_batch_loss, use_behaviour_logprobs  # noqa: E402
from trainer.testing import make_trajectory  # noqa: E402
from trainer.training import pack_cycle  # noqa: E402

TARGET = 1.25
VOCAB = 49_152


def build_cycle(groups: int, seed: int = 0) -> list:
    """Synthetic trajectories of ``groups`` task groups of 4 and 3 sessions (module doc)."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(groups):
        prompt = rng.integers(3, VOCAB, int(rng.integers(165, 231)))
        for _ in range(4 - g % 2):
            parts = [(prompt, 0), (rng.integers(3, VOCAB, int(rng.integers(25, 196))), 1)]
            ids = np.concatenate([p for p, _ in parts]).astype(np.int32)
            mask = np.concatenate([np.full(len(p), m, dtype=np.uint8) for p, m in parts])
            mu = np.where(mask == 1, rng.normal(-1.0, 0.3, len(ids)), 0.0).astype(np.float32)
            out.append(make_trajectory([Segment(ids, mask, mu)], float(rng.random()), task_id=f"t{g}"))
    return out


def run_layout(model, batches, config, placement) -> tuple[float, float]:
    """``(seconds, summed loss)`` of forward + loss + backward over ``batches``."""
    model.zero_grad(set_to_none=True)
    start, total = time.perf_counter(), 0.0
    for mb in batches:
        with placement.autocast():
            loss, _ = micro_batch_loss(model, mb, config)
        loss.backward()
        total += float(loss.detach())
    return time.perf_counter() - start, total


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--groups", type=int, default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    groups = args.groups or (8 if args.quick else 16)
    layers = args.layers or (4 if args.quick else 30)
    rounds = args.rounds or 1
    torch.set_num_threads(args.threads)
    placement = setup_placement("cpu")
    model = placement.place_model(build_model("smollm2-135m", layers))
    model.train()
    trajectories = build_cycle(groups)
    layouts = {}
    for name, share in (("shared", True), ("whole", False)):
        config = TrainerConfig.model_validate({"data": {"share_prefixes": share}})
        *_, batches = pack_cycle(trajectories, config)
        use_behaviour_logprobs(batches)
        layouts[name] = (config, batches)
    run_layout(model, layouts["whole"][1][:1], layouts["whole"][0], placement)  # warm-up
    best = {name: float("inf") for name in layouts}
    losses = {}
    for _ in range(rounds):
        for name, (config, batches) in layouts.items():
            seconds, losses[name] = run_layout(model, batches, config, placement)
            best[name] = min(best[name], seconds)
    tokens = sum(mb.num_tokens for mb in layouts["whole"][1])
    ours, baseline = tokens / best["shared"], tokens / best["whole"]
    loss_match = abs(losses["shared"] - losses["whole"]) <= 1e-3 * abs(losses["whole"]) + 1e-6
    shared_batches = layouts["shared"][1]
    line = {
        "bench": "shared_prefix",
        "ours": round(ours, 1),
        "baseline": round(baseline, 1),
        "unit": "rows' tokens/s (forward + loss + backward)",
        "ratio": round(ours / baseline, 3),
        "target": TARGET,
        "pass": bool(ours / baseline >= TARGET and loss_match),
        "loss_match": bool(loss_match),
        "trajectories": len(trajectories),
        "row_tokens": tokens,
        "computed_tokens": sum(mb.computed_tokens for mb in shared_batches),
        "padded_tokens": {
            "shared": sum(mb.input_ids.numel() + mb.prefix_ids.numel() for mb in shared_batches),
            "whole": sum(mb.input_ids.numel() for mb in layouts["whole"][1]),
        },
        "micro_batches": {name: len(b) for name, (_, b) in layouts.items()},
        "precision": placement.describe()["precision"],
        "layers": layers,
        "threads": args.threads,
    }
    print(json.dumps(line))


if __name__ == "__main__":
    main()

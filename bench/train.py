"""Trainer throughput next to a bare forward + backward of the same batch.

*Ours*: one optimizer step of :func:`trainer.step.train_steps` -- decoder forward, the policy loss
fused with the LM head on trainable tokens (:mod:`kernels.logprob_loss`), backward, gradient
clipping, AdamW -- over a batch of synthetic agent trajectories packed into micro-batches
(gradient accumulation). The *baseline* is the bare loop a training script starts from:
``model(input_ids).logits`` for every position, ``log_softmax(...).gather`` of the targets, a mean
over the model's tokens, backward -- no optimizer, no importance weights. Both see the very same
padded micro-batches; rounds alternate and the best round counts (the machine is shared).

The model has SmolLM2-135M's architecture (30 layers, hidden 576, vocab 49,152; random weights:
throughput does not depend on their values); ``--quick`` uses 4 layers. Tokens/s counts real
(non-padding) tokens. Ends with one JSON line: ours / baseline tokens/s (target >= 0.8; ``pass``
also requires the same ratio per CPU-second, steadier on a shared machine).
"""

from __future__ import annotations

import argparse
import json
import time

TARGET = 0.8


def build_model(layers: int):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=49_152, hidden_size=576, intermediate_size=1536, num_hidden_layers=layers,
                      num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
                      tie_word_embeddings=True, rms_norm_eps=1e-5, rope_theta=100_000.0)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg)


def build_batches(n_traj: int, seq_len: int, micro_batch_tokens: int):
    """Micro-batches of synthetic trajectories: alternating prompt/tool and model turns, about
    half of the tokens the model's own (as in agent sessions)."""
    import numpy as np
    import torch

    from trainer.batching import group_ids, pack_micro_batches
    from trainer.data import Segment
    from trainer.loss import compute_advantages
    from trainer.testing import make_trajectory

    rng = np.random.default_rng(0)
    trajs = []
    for i in range(n_traj):
        ids = rng.integers(3, 49_152, size=seq_len).astype(np.int32)
        mask = np.zeros(seq_len, dtype=np.uint8)
        for start in range(seq_len // 8, seq_len, seq_len // 4):
            mask[start:start + seq_len // 8] = 1
        lp = np.where(mask == 1, rng.normal(-2.0, 0.5, seq_len), 0.0).astype(np.float32)
        trajs.append(make_trajectory([Segment(ids, mask, lp)], float(i % 2), task_id=f"t{i // 2}"))
    adv = compute_advantages(torch.tensor([t.reward for t in trajs]), group_ids(trajs))
    return pack_micro_batches(trajs, adv, micro_batch_tokens=micro_batch_tokens)


def bare_step(model, batches) -> None:
    import torch

    model.zero_grad(set_to_none=True)
    for mb in batches:
        logits = model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).logits[:, :-1].float()
        logp = torch.log_softmax(logits, dim=-1).gather(2, mb.input_ids[:, 1:, None]).squeeze(2)
        mask = torch.zeros_like(logp, dtype=torch.bool).view(-1)
        mask[mb.hidden_index - torch.div(mb.hidden_index, mb.input_ids.shape[1], rounding_mode="floor")] = True
        loss = -(logp.reshape(-1)[mask]).sum() / 4096.0
        loss.backward()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="4 layers, smaller batch, 1 round")
    p.add_argument("--layers", type=int, default=30)
    p.add_argument("--trajectories", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--micro-batch-tokens", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.layers, args.trajectories, args.rounds = 4, 4, 1

    import torch

    from trainer.config import TrainerConfig
    from trainer.step import compute_old_logprobs, make_optimizer, train_steps

    torch.set_num_threads(args.threads)
    model = build_model(args.layers)
    batches = build_batches(args.trajectories, args.seq_len, args.micro_batch_tokens)
    tokens = sum(mb.num_tokens for mb in batches)
    config = TrainerConfig.model_validate({
        "grad_accum": len(batches), "epochs": 1, "threads": args.threads,
        "data": {"micro_batch_tokens": args.micro_batch_tokens}, "optim": {"lr": 1e-6}})
    compute_old_logprobs(model, batches, config)
    optimizer = make_optimizer(model, config)
    ours_s, bare_s, ours_cpu, bare_cpu = [], [], [], []
    train_steps(model, batches, config, optimizer)  # warm-up (allocator, AdamW state)
    bare_step(model, batches)
    for _ in range(args.rounds):
        start, cpu = time.perf_counter(), time.process_time()
        train_steps(model, batches, config, optimizer)
        ours_s.append(time.perf_counter() - start)
        ours_cpu.append(time.process_time() - cpu)
        start, cpu = time.perf_counter(), time.process_time()
        bare_step(model, batches)
        bare_s.append(time.perf_counter() - start)
        bare_cpu.append(time.process_time() - cpu)
    start = time.perf_counter()
    compute_old_logprobs(model, batches, config)  # warm, like the runs above
    old_pass_s = time.perf_counter() - start
    ours, bare = tokens / min(ours_s), tokens / min(bare_s)
    cycle = tokens / (min(ours_s) + old_pass_s)
    print(f"{args.layers} layers, {len(batches)} micro-batches, {tokens} tokens "
          f"({sum(mb.num_trainable for mb in batches)} trainable), {args.threads} threads")
    print(f"trainer step    {ours:10.1f} tok/s   (best of {[round(s, 2) for s in ours_s]} s)")
    print(f"bare fwd+bwd    {bare:10.1f} tok/s   (best of {[round(s, 2) for s in bare_s]} s)")
    print(f"cycle incl. pi_old pass, 1 epoch: {cycle:.1f} tok/s")
    cpu_ratio = min(bare_cpu) / min(ours_cpu)  # tokens per CPU-second, ours / baseline
    print(f"per CPU-second: ours / bare = {cpu_ratio:.3f}")
    print(json.dumps({"bench": "train", "ours": round(ours, 1), "baseline": round(bare, 1), "unit": "tokens/s",
                      "ratio": round(ours / bare, 3), "target": TARGET,
                      "pass": ours / bare >= TARGET and cpu_ratio >= TARGET, "cpu_ratio": round(cpu_ratio, 3),
                      "cycle_tokens_per_s_incl_old_logprob_pass": round(cycle, 1), "layers": args.layers,
                      "tokens": tokens, "quick": args.quick}))


if __name__ == "__main__":
    main()

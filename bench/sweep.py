"""Trainer sweep on one cycle's real data: which learning rate and epochs move held-out pass@1.

Runs one cycle of the deployed loop from base on the in-reach ``functions`` tasks (``flywheel demo
--cycles 1``, which drives ``flywheel up``: real SmolLM2 sessions on vLLM, the simulated developers'
signals, the implicit reward), stops the loop's processes (the servers and the stack stay), then
trains one candidate per grid point from base on exactly that cycle's trajectories (``flywheel train
--parent base --same-data-as C1 --config ...``) and evaluates every candidate and base on the same
held-out tasks and samples. Rollouts are shared by every grid point, so the comparison isolates the trainer
settings. Prints a table and ends with one JSON line whose ``ours`` is the best grid point's paired
difference against base and ``baseline`` the default config's.

Flags: ``--quick`` (2 grid points, fewer sessions and tasks), ``--lr`` and ``--epochs`` (comma-separated
grid values), ``--grad-accum N`` (4), ``--sessions N``, ``--group-size N`` (8), ``--eval-tasks N``,
``--max-turns N`` (2), ``--max-tokens-per-turn N`` (192), ``--seed N`` (0), ``--home DIR``, ``--keep``.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import subprocess
import sys
import tempfile
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from flywheel import SUITE, flywheel, paired, stop_loop, succeeded_cycles, train_from_base  # noqa: E402

from app.core.db import session_scope
from app.core.settings import get_settings
from trainer.config import DEFAULT_CONFIG


def write_config(directory: Path, lr: float, epochs: int, grad_accum: int) -> Path:
    """A trainer TOML: the packaged defaults with ``lr``, ``epochs`` and ``grad_accum`` replaced."""
    raw = tomllib.loads(DEFAULT_CONFIG.read_text())
    raw.update(epochs=epochs, grad_accum=grad_accum)
    raw["optim"]["lr"] = lr
    lines = [f"{k} = {json.dumps(v)}" for k, v in raw.items() if not isinstance(v, dict)]
    for section, values in raw.items():
        if isinstance(values, dict):
            lines += [f"[{section}]"] + [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    path = directory / f"lr{lr:g}-e{epochs}-ga{grad_accum}.toml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="2 grid points, fewer sessions and tasks")
    parser.add_argument("--lr", default=None, help="comma-separated learning rates")
    parser.add_argument("--epochs", default=None, help="comma-separated epochs per cycle")
    parser.add_argument("--grad-accum", type=int, default=4)
    parser.add_argument("--sessions", type=int, default=None)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--eval-tasks", type=int, default=None)
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens-per-turn", type=int, default=192)
    parser.add_argument("--seed", type=int, default=0, help="seeds the traffic and the training order")
    parser.add_argument("--home", default=None)
    parser.add_argument("--keep", action="store_true")
    args = parser.parse_args()
    lrs = [float(x) for x in (args.lr or ("1e-5,5e-5" if args.quick else "5e-6,1e-5,3e-5,1e-4")).split(",")]
    epochs = [int(x) for x in (args.epochs or ("2" if args.quick else "1,2")).split(",")]
    sessions = args.sessions or (32 if args.quick else 64)
    eval_tasks = args.eval_tasks or (40 if args.quick else 80)

    home = Path(args.home or tempfile.mkdtemp(prefix="flywheel-sweep-")).resolve()
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    os.environ["FLYWHEEL_HOME"] = str(home)
    started = time.monotonic()
    rows = []
    try:
        budget = ["--max-turns", str(args.max_turns), "--max-tokens-per-turn", str(args.max_tokens_per_turn)]
        demo = ["demo", "--cycles", "1", "--sessions", str(sessions), "--group-size", str(args.group_size)]
        demo += ["--source", SUITE, "--suite", SUITE, *budget, "--eval-max-turns", str(args.max_turns)]
        demo += ["--eval-tasks", str(eval_tasks), "--ab-tasks", "0", "--seed", str(args.seed)]
        flywheel(demo, env)
        stop_loop(home)  # no scheduled cycle races the grid's training for the lock
        get_settings.cache_clear()
        with session_scope() as session:
            cycles = succeeded_cycles(session)
        if not cycles:
            raise SystemExit("the loop's first cycle registered no checkpoint")
        first = cycles[0].checkpoint_id
        configs = home / "sweep"
        configs.mkdir(exist_ok=True)

        for lr, ep in itertools.product(lrs, epochs):
            t0 = time.monotonic()
            cfg = write_config(configs, lr, ep, args.grad_accum)
            ckpt = train_from_base(env, first, invert=False, trainer_config=str(cfg))
            flywheel(
                [
                    "eval",
                    "run",
                    ckpt,
                    "--suite",
                    SUITE,
                    "--samples",
                    "1",
                    "--limit",
                    str(eval_tasks),
                    "--max-turns",
                    str(args.max_turns),
                    "--max-tokens",
                    str(args.max_tokens_per_turn),
                ],
                env,
            )
            with session_scope() as session:
                cmp = paired(session, "base", ckpt, SUITE)
            rows.append(
                {
                    "lr": lr,
                    "epochs": ep,
                    "grad_accum": args.grad_accum,
                    "checkpoint": ckpt,
                    **cmp,
                    "seconds": round(time.monotonic() - t0),
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        with session_scope() as session:
            default = paired(session, "base", first, SUITE)
    finally:
        if not args.keep:
            subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True)
    best = max(rows, key=lambda r: (r["lower_bound"], r["diff"]))
    print(
        json.dumps(
            {
                "bench": "sweep",
                "ours": best["diff"],
                "baseline": default["diff"],
                "unit": "held-out pass@1 difference vs base",
                "ratio": None,
                "target": "a grid point with lower bound > 0",
                "best": best,
                "default": default,
                "grid": rows,
                "sessions": sessions,
                "eval_tasks": eval_tasks,
                "wall_s": round(time.monotonic() - started),
                "pass": best["lower_bound"] > 0,
            }
        )
    )


if __name__ == "__main__":
    main()

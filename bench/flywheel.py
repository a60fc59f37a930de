"""Does the flywheel learn? K full cycles from base on the real SmolLM2, measured on held-out tasks.

One run, on a fresh embedded stack (its own ``FLYWHEEL_HOME``):

1. ``flywheel demo --cycles K`` on the in-reach ``functions`` tasks: each cycle simulates developer
   sessions served by production (train templates), consumes them, trains a candidate, gates it on
   the held-out ``functions`` suite (templates never trained on) and promotes or rejects it through
   the promotion API.
2. A planted regression: a candidate trained from base on exactly cycle 1's data with the reward's
   sign flipped (``flywheel train --parent base --same-data-as C1 --invert-reward``), gated against
   base on the same suite. It must be rejected.
3. Held-out pass@1 of base and of the final production checkpoint on the same held-out tasks and
   samples (one ``eval`` run each; the gates' runs are reused when the plan matches), the paired
   difference and its one-sided 95 % lower bound (task-clustered bootstrap, ``evals.gate``).
4. Product signals before and after: the sessions base served (cycle 1) against sessions served by
   the final checkpoint (one more simulation round, not trained on).

Prints one JSON line: ``ours`` = final held-out pass@1, ``baseline`` = base, ``diff`` and
``lower_bound``, ``planted_rejected``, ``signals_before`` / ``signals_after``. ``pass``: default run,
``diff >= 0.10`` and ``lower_bound > 0`` and the planted regression rejected; ``--quick``,
``lower_bound > 0`` and the planted regression rejected.

Flags: ``--quick`` (1 cycle instead of 3), ``--cycles K``, ``--sessions N`` (simulated sessions per
cycle), ``--group-size N`` (sessions per task, the GRPO group; 4), ``--eval-tasks N`` (held-out
tasks for the gates and the comparison), ``--max-turns N`` (2), ``--max-tokens-per-turn N`` (192),
``--trainer-config TOML``, ``--difficulty-mix MIX`` (the simulated requests' levels; the demo's),
``--params-split`` (also compare the final checkpoint, or cycle 1's candidate when none was
promoted, with base on ``functions_params``, unseen parameters of the training templates:
``params_split`` in the JSON line, its ``checkpoint`` named), ``--home DIR`` (the ``FLYWHEEL_HOME``
to use; resumes a run), ``--keep`` (leave the stack running). Measured results and time budgets:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SUITE = "functions"
PARAMS_SUITE = "functions_params"  # the second held-out set: unseen parameters of training templates
HELD_OUT_TASKS = 112  # every task of the held-out templates (evals/suites/functions.toml)


def flywheel(args: list[str], env: dict[str, str], *, capture: bool = False) -> str:
    """Run ``flywheel ARGS`` in a subprocess; its stdout when ``capture``.

    Raises:
        SystemExit: the command failed.
    """
    proc = subprocess.run(
        [sys.executable, "-m", "ops.cli", *args], env=env, text=True, stdout=subprocess.PIPE if capture else None
    )
    if proc.returncode != 0:
        raise SystemExit(f"`flywheel {' '.join(args)}` exited with {proc.returncode}")
    return proc.stdout or ""


def last_json(out: str) -> dict:
    return json.loads([ln for ln in out.splitlines() if ln.startswith("{")][-1])


def run_demo(
    cycles: int,
    sessions: int,
    group_size: int,
    eval_tasks: int,
    max_turns: int,
    max_tokens_per_turn: int,
    env: dict[str, str],
    *,
    trainer_config: str | None = None,
    difficulty_mix: str | None = None,
) -> None:
    """``flywheel demo`` on the in-reach suite: ``cycles`` cycles of ``sessions`` simulated sessions,
    gated on ``eval_tasks`` held-out tasks alone (turn and token budgets as given); the simulated
    requests' difficulty mix is the demo's unless ``difficulty_mix`` is given.

    Raises:
        SystemExit: the demo failed.
    """
    flywheel(
        [
            "demo",
            "--cycles",
            str(cycles),
            "--sessions",
            str(sessions),
            "--group-size",
            str(group_size),
            "--source",
            SUITE,
            "--suite",
            SUITE,
            "--eval-tasks",
            str(eval_tasks),
            "--eval-max-turns",
            str(max_turns),
            "--max-turns",
            str(max_turns),
            "--max-tokens-per-turn",
            str(max_tokens_per_turn),
            *(["--trainer-config", trainer_config] if trainer_config else []),
            *(["--difficulty-mix", difficulty_mix] if difficulty_mix else []),
        ],
        env,
    )


def paired(session, base: str, final: str, suite: str) -> dict:
    """Paired held-out comparison of ``final`` against ``base`` on the newest succeeded runs of one plan."""
    from sqlalchemy import select

    from app.models import EvalResult, EvalRun
    from evals.gate import paired_bootstrap_interval

    def results(ckpt: str) -> tuple[str, dict]:
        run = session.scalars(
            select(EvalRun)
            .where(EvalRun.checkpoint_id == ckpt, EvalRun.suite == suite, EvalRun.status == "succeeded")
            .order_by(EvalRun.started_at.desc())
        ).first()
        rows = session.scalars(select(EvalResult).where(EvalResult.run_id == run.id)).all()
        return run.suite_version, {(r.task_id, r.sample_index): bool(r.passed) for r in rows}

    version_b, base_res = results(base)
    version_f, final_res = results(final)
    if version_b != version_f:
        raise SystemExit(f"base and final were evaluated on different plans ({version_b} vs {version_f})")
    keys = sorted(set(base_res) & set(final_res))
    diffs = [int(final_res[k]) - int(base_res[k]) for k in keys]
    low, _ = paired_bootstrap_interval([k[0] for k in keys], diffs, confidence=0.95, two_sided=False)
    n = len(keys)
    return {
        "pairs": n,
        "base": sum(base_res[k] for k in keys) / n,
        "final": sum(final_res[k] for k in keys) / n,
        "diff": sum(diffs) / n,
        "lower_bound": low,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 cycle instead of 3")
    parser.add_argument("--cycles", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None, help="simulated sessions per cycle")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task (GRPO group)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks (gates and the comparison)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens-per-turn", type=int, default=192)
    parser.add_argument("--trainer-config", default=None, help="trainer TOML (default: the packaged one)")
    parser.add_argument("--difficulty-mix", default=None, help="simulated requests' levels, e.g. 1:1 (the demo's)")
    parser.add_argument(
        "--params-split",
        action="store_true",
        help="also compare the final checkpoint (cycle 1's candidate if none was promoted) with base on functions_params",
    )
    parser.add_argument("--home", default=None, help="FLYWHEEL_HOME to use (resumes a run; default: a new one)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    args = parser.parse_args()
    cycles = args.cycles or (1 if args.quick else 3)
    sessions = args.sessions or 64
    eval_tasks = args.eval_tasks or HELD_OUT_TASKS

    home = Path(args.home or tempfile.mkdtemp(prefix="flywheel-bench-")).resolve()
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    os.environ["FLYWHEEL_HOME"] = str(home)
    started = time.monotonic()
    common = ["--max-turns", str(args.max_turns), "--max-tokens-per-turn", str(args.max_tokens_per_turn)]
    eval_budget = ["--max-turns", str(args.max_turns), "--max-tokens", str(args.max_tokens_per_turn)]
    try:
        run_demo(
            cycles,
            sessions,
            args.group_size,
            eval_tasks,
            args.max_turns,
            args.max_tokens_per_turn,
            env,
            trainer_config=args.trainer_config,
            difficulty_mix=args.difficulty_mix,
        )
        state = json.loads((home / "demo" / "state.json").read_text())
        first = state["candidate@1"]
        planted = last_json(
            flywheel(
                [
                    "train",
                    "--once",
                    "--json",
                    "--parent",
                    "base",
                    "--same-data-as",
                    first,
                    "--invert-reward",
                    "--min-new",
                    "1",
                    "--no-progress",
                    *(["--config", args.trainer_config] if args.trainer_config else []),
                ],
                env,
                capture=True,
            )
        )["checkpoint_id"]
        gate = last_json(
            flywheel(
                [
                    "gate",
                    planted,
                    "--production",
                    "base",
                    "--suite",
                    SUITE,
                    "--gate-on",
                    SUITE,
                    "--samples",
                    "1",
                    "--limit",
                    str(eval_tasks),
                    "--min-pairs",
                    str(eval_tasks),
                    *eval_budget,
                    "--json",
                ],
                env,
                capture=True,
            )
        )

        from app.core.db import session_scope
        from app.core.settings import get_settings
        from app.repositories.checkpoints import get_production
        from ops.curves import product_signals

        get_settings.cache_clear()
        with session_scope() as session:
            final = get_production(session).id
        # The params split compares what the run ended with: the final checkpoint, or cycle 1's
        # candidate when no cycle was promoted.
        params_ckpt = final if final != "base" else first
        if args.params_split:
            for ckpt in ("base", params_ckpt):
                flywheel(["eval", "run", ckpt, "--suite", PARAMS_SUITE, *eval_budget, "--json"], env, capture=True)
        # Signals after: sessions the final checkpoint serves (not trained on: no cycle follows).
        if final != "base":
            flywheel(
                [
                    "simulate",
                    "--sessions",
                    str(sessions),
                    "--group-size",
                    str(args.group_size),
                    "--source",
                    SUITE,
                    "--max-tokens",
                    str(args.max_turns * args.max_tokens_per_turn),
                    "--seed",
                    "777",
                    *common,
                ],
                env,
            )
            deadline = time.monotonic() + 300
            from sqlalchemy import text

            while time.monotonic() < deadline:
                with session_scope() as session:
                    open_ = session.scalar(text("SELECT count(*) FROM trajectory WHERE status <> 'finalized'"))
                if not open_:
                    break
                time.sleep(2)
        with session_scope() as session:
            comparison = paired(session, "base", final, SUITE) if final != "base" else None
            before = product_signals(session, "base")
            after = product_signals(session, final) if final != "base" else before
            params = (
                {"checkpoint": params_ckpt, **paired(session, "base", params_ckpt, PARAMS_SUITE)}
                if args.params_split
                else None
            )
    finally:
        if not args.keep:
            subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True)

    rejected = not gate["passed"]
    if comparison is None:  # no candidate was promoted: the final checkpoint is base
        comparison = {"pairs": 0, "base": None, "final": None, "diff": 0.0, "lower_bound": 0.0}
    lb, diff = comparison["lower_bound"], comparison["diff"]
    ok = (lb > 0 and rejected) if args.quick else (diff >= 0.10 and lb > 0 and rejected)
    print(
        json.dumps(
            {
                "bench": "flywheel",
                "ours": comparison["final"],
                "baseline": comparison["base"],
                "unit": "held-out pass@1",
                "ratio": (comparison["final"] / comparison["base"] if comparison["base"] else None),
                "target": "final - base >= 0.10 with lower bound > 0" if not args.quick else "lower bound > 0",
                "diff": diff,
                "lower_bound": lb,
                "pairs": comparison["pairs"],
                "final_checkpoint": final,
                "planted_checkpoint": planted,
                "planted_rejected": rejected,
                "planted_failures": gate.get("failures"),
                "params_split": params,
                "signals_before": before,
                "signals_after": after,
                "cycles": cycles,
                "sessions_per_cycle": sessions,
                "wall_s": round(time.monotonic() - started),
                "home": str(home) if args.keep else None,
                "pass": ok,
            }
        )
    )


if __name__ == "__main__":
    main()

"""The bench's evidence on outcomes no gate chose by (``bench/flywheel.py``; issue 70).

- The report split (``evals/suites/functions_report.toml``): held-out templates no cycle trains on and
  no gate reads, run on base, on every candidate and on the final production checkpoint at k samples
  at the serving temperature. Production was chosen by gate decisions on the ``functions`` suite, so
  its figure on that suite is the winner of a selection; on the report split it is not. The
  comparisons pair by (task, sample) and cluster by template, as the gate does.
- The one-cycle contrast: from base, on one cycle's trajectories, true rewards against rewards
  shuffled within each task group, each arm trained at several trainer seeds (twins), every
  checkpoint run on the report split. The spread between twins of one arm is the run-to-run noise the
  arms' difference has to clear.

Every figure is read from the database the loop wrote (``ops/loop_outcome.py``), never from a
command's printed output.
"""

from __future__ import annotations

import statistics
import subprocess
import sys
from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from app.core.db import session_scope
from evals.tasks.functions import FRESH_MIN_SKELETON_DISTANCE
from ops.loop_outcome import paired, succeeded_cycles

REPORT_SUITE = "functions_report"  # the report split's suite: never gated (evals/gate.toml)
FRESH_BASE_TARGET = (0.15, 0.35)  # base's pass rate on fresh traffic at production difficulty (issue 70)


def flywheel(args: list[str], env: dict[str, str]) -> None:
    """Run ``flywheel ARGS`` in a subprocess, its output passed through.

    Raises:
        SystemExit: the command failed.
    """
    proc = subprocess.run([sys.executable, "-m", "ops.cli", *args], env=env)
    if proc.returncode != 0:
        raise SystemExit(f"`flywheel {' '.join(args)}` exited with {proc.returncode}")


def train_from_base(
    env: dict[str, str],
    data_of: str,
    *,
    invert: bool = False,
    trainer_config: str | None = None,
    seed: int | None = None,
    placebo: str | None = None,
) -> str:
    """One normal cycle from base on ``data_of``'s trajectories at the trainer's defaults (reward sign
    flipped with ``invert``; trainer ``seed`` overridden where given; rewards shuffled with ``placebo``,
    a ``data.placebo_mode``). Returns the new checkpoint's id (read from the cycle's row).

    Raises:
        SystemExit: the cycle failed or registered no checkpoint.
    """
    with session_scope() as session:
        since = session.scalar(select(func.now()))
    args = ["train", "--once", "--parent", "base", "--same-data-as", data_of, "--min-new", "1", "--no-progress"]
    args += [*(["--invert-reward"] if invert else []), *(["--config", trainer_config] if trainer_config else [])]
    args += [*(["--seed", str(seed)] if seed is not None else [])]
    args += [*(["--placebo", "--placebo-mode", placebo] if placebo else [])]
    flywheel(args, env)
    with session_scope() as session:
        cycles = succeeded_cycles(session, since)
    if not cycles or cycles[-1].checkpoint_id is None:
        raise SystemExit("the cycle from base registered no checkpoint")
    return cycles[-1].checkpoint_id


def run_report(env: dict[str, str], checkpoints: list[str], eval_budget: list[str], samples: int | None) -> None:
    """``flywheel eval CKPT --suite functions_report`` on each distinct checkpoint (base first), at the
    suite's k samples (``samples`` overrides it) and the bench's turn budget. A run of the same plan
    that already succeeded is reused (the runner's own rule)."""
    for ckpt in dict.fromkeys(["base", *checkpoints]):
        args = ["eval", ckpt, "--suite", REPORT_SUITE, *eval_budget]
        flywheel([*args, *(["--samples", str(samples)] if samples else []), "--json"], env)


def held_out_report(session: Session, final: str, candidates: list[str]) -> dict[str, Any]:
    """The bench's ``held_out``: production (``final``) against base on the report split, with the
    last candidate's comparison beside it (``last_candidate``: what a loop that kept its newest
    checkpoint would have) and each candidate's (``candidates``)."""
    last = candidates[-1] if candidates else "base"
    return {
        "split": "report",
        "suite": REPORT_SUITE,
        "gated": False,
        "checkpoint": final,
        **paired(session, "base", final, REPORT_SUITE, by_template=True),
        "last_candidate": {"checkpoint": last, **paired(session, "base", last, REPORT_SUITE, by_template=True)},
        "candidates": [
            {"checkpoint": c, **paired(session, "base", c, REPORT_SUITE, by_template=True)} for c in candidates
        ],
    }


def fresh_view(in_distribution: dict[str, Any]) -> dict[str, Any]:
    """The bench's ``fresh``: the fresh-traffic A/B (``flywheel ab``'s default draw, the ``fresh``
    split) with base's rate as ``base``, whether it lies in :data:`FRESH_BASE_TARGET` (a base that can
    move either way), and the split's stated distance from training (``min_skeleton_distance``)."""
    base = in_distribution.get("base")
    return {
        "split": "fresh",
        **{k: in_distribution.get(k) for k in ("pairs", "tasks", "samples", "base", "final", "diff", "ci")},
        "lower_bound": in_distribution.get("lower_bound"),
        "base_target": list(FRESH_BASE_TARGET),
        "base_in_target": base is not None and FRESH_BASE_TARGET[0] <= base <= FRESH_BASE_TARGET[1],
        "min_skeleton_distance": FRESH_MIN_SKELETON_DISTANCE,
    }


def one_cycle_arms(
    env: dict[str, str], data_of: str, seeds: list[int], trainer_config: str | None, true_twins: dict[int, str]
) -> dict[str, dict[int, str]]:
    """Train the one-cycle contrast's arms from base on ``data_of``'s trajectories: ``true`` (its
    rewards) and ``shuffled`` (within each task group) at each trainer seed in ``seeds``. A true-reward
    checkpoint already trained at a seed (``true_twins``, e.g. the plant's control) is reused.
    Returns ``{arm: {seed: checkpoint}}``."""
    arms: dict[str, dict[int, str]] = {"true": {}, "shuffled": {}}
    for seed in seeds:
        arms["true"][seed] = true_twins.get(seed) or train_from_base(
            env, data_of, trainer_config=trainer_config, seed=seed
        )
        arms["shuffled"][seed] = train_from_base(
            env, data_of, trainer_config=trainer_config, seed=seed, placebo="within_group"
        )
    return arms


def one_cycle_contrast(session: Session, data_of: str, arms: dict[str, dict[int, str]]) -> dict[str, Any]:
    """The bench's ``one_cycle``: each twin against base on the report split; per seed, true against
    shuffled (paired, template-clustered); ``diff``, the mean over seeds of true minus shuffled; and
    ``spread``, per arm the largest minus the smallest twin's pass rate (points of pass rate, 0-1), and
    ``max`` of the two: a ``diff`` inside ``spread`` is within run-to-run noise.

    Raises:
        SystemExit: a checkpoint has no report run (``run_report`` first).
    """
    twins = {
        arm: [
            {"seed": seed, "checkpoint": ckpt, **paired(session, "base", ckpt, REPORT_SUITE, by_template=True)}
            for seed, ckpt in sorted(by_seed.items())
        ]
        for arm, by_seed in arms.items()
    }
    seeds = sorted(set(arms["true"]) & set(arms["shuffled"]))
    contrasts = [
        {"seed": s, **paired(session, arms["shuffled"][s], arms["true"][s], REPORT_SUITE, by_template=True)}
        for s in seeds
    ]
    spread = {arm: max(t["final"] for t in ts) - min(t["final"] for t in ts) for arm, ts in twins.items() if ts}
    return {
        "data_of": data_of,
        "split": "report",
        "arms": twins,
        "twins": min(len(ts) for ts in twins.values()),
        "true_vs_shuffled": contrasts,
        "diff": statistics.fmean(c["diff"] for c in contrasts) if contrasts else None,
        "spread": {**spread, "max": max(spread.values(), default=None)},
    }

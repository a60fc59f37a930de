"""Does the flywheel learn what users care about? K full cycles from base on the real SmolLM2, then a paired A/B on fresh traffic.

One run, on a fresh embedded stack (its own ``FLYWHEEL_HOME``):

1. ``flywheel demo --cycles K`` on the in-reach ``functions`` tasks: each cycle simulates developer
   sessions served by production (train templates, the request mix ``--difficulty-mix``), consumes
   them, trains a candidate, gates it on the held-out ``functions`` suite (templates never trained
   on) and promotes or rejects it through the promotion API.
2. A planted regression: a candidate trained from base for 4 optimizer steps on cycle 1's data with
   the reward's sign flipped at lr 1e-4 (10x the default) and the KL stop out of reach (``flywheel train
   --parent base --same-data-as C1 --invert-reward --lr 1e-4 --max-steps 4``), gated against base on
   the same suite. It must be rejected.
3. In distribution (``flywheel ab base FINAL``, ``ops/ab.py``): fresh requests of the production
   request distribution (the training templates with the same mix) whose parameters no training
   cycle used (``functions`` ``test_params``), each (task, sample) served once by base and once by
   the final production checkpoint on the eval server at the serving temperature and answered by
   the same seeded simulated developer. Hidden-test pass rate and product signals of both arms,
   each with the 95 % interval of the paired difference, clustered by task (delta method). Its
   sessions never reach the event stream.
4. Held out: base against the final checkpoint on the held-out templates (the gates' eval runs,
   reused when the plan matches), the paired difference and its one-sided 95 % lower bound
   (task-clustered bootstrap, ``evals.gate``).
5. The curve: after each cycle, the checkpoint production serves, measured on the first tasks of
   the same A/B draw (``--curve-pairs``; base's and the final checkpoint's sessions are reused, so
   only an intermediate promoted checkpoint costs sessions).

Prints one JSON line:

- ``in_distribution``: ``pairs``, ``tasks``, ``samples``, ``base``, ``final`` (pass rates),
  ``diff`` (final - base), ``ci`` (two-sided 95 %), ``lower_bound`` (one-sided 95 %);
- ``held_out``: ``pairs``, ``base``, ``final``, ``diff``, ``lower_bound`` (one-sided 95 %);
- ``signals_ab``: ``edit_persistence``, ``dissatisfied_followup_rate``, ``mean_completion_tokens``,
  ``mean_latency_s``, ``edit_acceptance``, each ``{"base", "final", "diff", "ci": [lo, hi]}`` from the
  same A/B (latency: the serving seconds per session the simulator reports);
- ``curve``: per cycle ``{"cycle", "candidate", "promoted", "checkpoint", "pairs", "pass_rate",
  "ci", "diff_vs_base", "diff_ci", "signals"}`` (``checkpoint``: what production serves after it);
- ``budget_s``: seconds per phase summed over cycles (``setup``, ``simulate``, ``consume``,
  ``train``, ``eval``, ``gate``, ``release``, ``report``, ``ab``, ``curve``): the demo's steps timed
  from its output, ``eval`` the eval runs' own durations (taken out of ``gate``), the planted
  regression's training and gate added to ``train`` and ``gate``/``eval``;
- ``planted_rejected``, ``planted_failures``, ``planted`` (its ``lr``, ``steps`` and held-out
  comparison with base: ``pairs``, ``base``, ``final`` (the planted candidate's pass rate), ``diff``,
  ``lower_bound``), ``final_checkpoint``, ``margin`` (the held-out suite's non-inferiority margin,
  ``evals/gate.toml``), ``multi_segment_sessions`` (simulated sessions whose agent self-summarized),
  ``trainer_config`` and ``lr`` (the cycles' trainer config file and learning rate), ``wall_s``,
  ``pass``.

``pass``, default run: in-distribution ``diff >= 0.10`` with ``lower_bound > 0``, edit persistence
up and dissatisfied follow-ups down each with a 95 % interval excluding 0, held-out ``lower_bound >
-margin``, and the planted regression rejected. ``--quick``: at least 200 in-distribution pairs,
``diff > 0``, and the planted regression rejected.

Sizes: the A/B draws every ``test_params`` task at the mix's levels (46 at all levels, 35 at level 1)
and samples each ``ceil(pairs / tasks)`` times: ``--ab-pairs`` 400 by default; ``--quick`` draws 40
tasks x 5 samples, 200 pairs. Both train with the trainer's defaults (``--trainer-config`` to
change them). ``--quick`` (1 cycle of 128 sessions, a 200-pair A/B = 400 sessions of at most 2 x 192
tokens, about 100 each) aims at 15 minutes on the idle 2-core machine with vLLM, the default (4
cycles of 256 sessions) at 60 minutes (docs/benchmarks.md has the measured budget). Measured, one
cycle of 128 sessions moves fresh traffic by less than 200 pairs can see (docs/benchmarks.md):
``--quick`` checks the whole loop, the default run is the one sized to show learning.

Flags: ``--quick``, ``--cycles K`` (4), ``--sessions N`` (simulated sessions per cycle, 256; quick 128),
``--group-size N`` (4), ``--eval-tasks N`` (held-out tasks for the gates, all 112), ``--max-turns N``
(2), ``--max-tokens-per-turn N`` (192), ``--trainer-config TOML`` (``default.toml``),
``--difficulty-mix MIX`` (the
demo's by default), ``--ab-pairs N``, ``--ab-tasks N`` (fewer tasks, more samples each),
``--curve-pairs N`` (100), ``--home DIR`` (the ``FLYWHEEL_HOME`` to use; resumes a run), ``--keep``
(leave the stack running). Measured results: ``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from sqlalchemy import func, select

from app.core.db import session_scope
from app.core.settings import get_settings
from app.models import EvalResult, EvalRun, Promotion
from app.repositories.checkpoints import get_production
from evals.config import load_gate_config
from evals.gate import paired_bootstrap_interval
from ops.ab import ABConfig, plan_pairs
from ops.demo import CURVE_SIGNALS, DEFAULT_DIFFICULTY_MIX, curve_point, render_curve_png
from ops.report import count_multi_segment_sessions
from ops.simulator_cli import parse_mix
from trainer.config import load_config

SUITE = "functions"
OVERRIDE_REASON = (
    "bench/flywheel: the held-out gate is sized for CPU time, not power; insufficient evidence is "
    "promoted so the fresh-traffic A/B can measure what the loop does to production"
)
# The planted regression stands for an update that went wrong unnoticed: the first PLANTED_STEPS
# optimizer steps of cycle 1's data with the reward's sign flipped, at lr 1e-4, with the update watch's
# KL stop out of reach. Measured on the held-out templates (docs/benchmarks.md): at lr 1e-5 it moved
# them by 0/112, at 5e-5 for a whole cycle by -4/112, which 112 greedy pairs cannot call (power 0.23
# at the 4.5-point margin); this plant scored 0-12 of 112 against base's 19 in five draws,
# its completions at the token limit.
PLANTED_LR = 1e-4
PLANTED_STEPS = 4
PLANTED_MAX_KL = 100.0
HELD_OUT_TASKS = 112  # every task of the held-out templates (evals/suites/functions.toml)
SIGNALS = (
    "edit_persistence",
    "dissatisfied_followup_rate",
    "mean_completion_tokens",
    "mean_latency_s",
    "edit_acceptance",
)
# A demo step's first line: "[5/14] simulate (cycle 1/3): ..." (also "... : done earlier").
STEP_LINE = re.compile(r"^\[\d+/\d+\] (\w+)(?: \(cycle \d+/\d+\))?: ")
PHASE_OF_STEP = {"stack": "setup", "model": "setup", "serving": "setup", "services": "setup", "finalize": "consume"}


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


def timed_flywheel(args: list[str], env: dict[str, str], budget: dict[str, float], phase: str) -> str:
    """:func:`flywheel` with captured stdout, its seconds added to ``budget[phase]``."""
    t0 = time.monotonic()
    try:
        return flywheel(args, env, capture=True)
    finally:
        budget[phase] += time.monotonic() - t0


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
    timings: dict[str, float] | None = None,
) -> None:
    """``flywheel demo`` on the in-reach suite: ``cycles`` cycles of ``sessions`` simulated sessions,
    gated on ``eval_tasks`` held-out tasks alone (turn and token budgets as given); the simulated
    requests' difficulty mix is the demo's unless ``difficulty_mix`` is given. With ``timings``, the
    demo's output is passed through and each step's seconds (from its first line to the next
    step's) are added to ``timings[step]``.

    Raises:
        SystemExit: the demo failed.
    """
    flags = {
        "--cycles": cycles,
        "--sessions": sessions,
        "--group-size": group_size,
        "--source": SUITE,
        "--suite": SUITE,
        "--eval-tasks": eval_tasks,
        "--eval-max-turns": max_turns,
        "--max-turns": max_turns,
        "--max-tokens-per-turn": max_tokens_per_turn,
        "--trainer-config": trainer_config,
        "--difficulty-mix": difficulty_mix,
        "--ab-tasks": 0,  # the bench measures its own curve on the A/B's draw
        # CPU-sized gates cannot reach the power to pass (docs/gate.md), so nothing would ever be
        # promoted; the bench's release manager promotes over insufficient evidence, audited, and
        # the planted regression must still end "fail". Measured on fresh traffic by the A/B.
        "--override-insufficient": OVERRIDE_REASON,
    }
    args = ["demo", *(x for k, v in flags.items() if v is not None for x in (k, str(v)))]
    if timings is None:
        flywheel(args, env)
        return
    time_steps([sys.executable, "-m", "ops.cli", *args], env, timings)


def time_steps(cmd: list[str], env: dict[str, str], timings: dict[str, float]) -> None:
    """Run ``cmd`` (a ``flywheel demo``), passing its output through, and add each step's seconds,
    from its first line (:data:`STEP_LINE`) to the next step's or the end, to ``timings[step]``.

    Raises:
        SystemExit: the command failed.
    """
    proc = subprocess.Popen(cmd, env={**env, "PYTHONUNBUFFERED": "1"}, stdout=subprocess.PIPE, text=True, bufsize=1)
    step, since = None, time.monotonic()
    for line in proc.stdout:
        sys.stdout.write(line)
        if m := STEP_LINE.match(line):
            now = time.monotonic()
            if step is not None:
                timings[step] = timings.get(step, 0.0) + now - since
            step, since = m.group(1), now
    if step is not None:
        timings[step] = timings.get(step, 0.0) + time.monotonic() - since
    if proc.wait() != 0:
        raise SystemExit(f"`{' '.join(cmd[3:])}` exited with {proc.returncode}")


def paired(session, base: str, final: str, suite: str) -> dict:
    """Paired held-out comparison of ``final`` against ``base`` on the newest succeeded runs of one plan."""

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


def served_after_cycles(session, state: dict, cycles: int) -> list[dict]:
    """Per cycle: its candidate, whether it was promoted, and what production serves after it."""
    promoted = set(session.scalars(select(Promotion.checkpoint_id).where(Promotion.kind == "promotion")))
    out, serving = [], "base"
    for c in range(1, cycles + 1):
        candidate = state.get(f"candidate@{c}")
        if candidate in promoted:
            serving = candidate
        out.append({"cycle": c, "candidate": candidate, "promoted": candidate in promoted, "checkpoint": serving})
    return out


def eval_seconds(session) -> float:
    """Seconds the eval runs of this home took, each from its start to its finish."""
    total = session.scalar(
        select(func.sum(func.extract("epoch", EvalRun.finished_at - EvalRun.started_at))).where(
            EvalRun.finished_at.is_not(None)
        )
    )
    return float(total or 0.0)


def ab_metrics(report: dict) -> tuple[dict, dict]:
    """``(in_distribution, signals_ab)`` of a ``flywheel ab --json`` report."""
    m = report["metrics"]
    pr = m["pass_rate"]
    in_dist = {
        "pairs": report["pairs"],
        "tasks": report["tasks"],
        "samples": report["config"]["samples"],
        "base": pr["base"],
        "final": pr["final"],
        "diff": pr["diff"],
        "ci": pr["ci"],
        "lower_bound": report["pass_rate_lower_bound"],
        "errors": len(report["errors"]),
    }
    signals = {n: {k: m[n][k] for k in ("base", "final", "diff", "ci")} for n in SIGNALS}
    return in_dist, signals


def plot_points(curve: list[dict], measured: dict[str, dict]) -> list[dict]:
    """The curve as :func:`ops.demo.render_curve_png` draws it: base first (cycle 0, from the first
    measured A/B's base arm), then each cycle's served checkpoint (:func:`ops.demo.curve_point`, as
    the demo's report builds it), each with its 95 % intervals."""
    if not curve:
        return []
    first = measured[curve[0]["checkpoint"]]["metrics"]
    base = {
        "cycle": 0,
        "checkpoint_id": "base",
        "pass_rate": first["pass_rate"]["base"],
        "pass_rate_ci": first["pass_rate"]["base_ci"],
        "signals": {n: {"value": first[n]["base"], "ci": first[n]["base_ci"]} for n in CURVE_SIGNALS if n in first},
    }
    return [base, *(curve_point(p["cycle"], measured[p["checkpoint"]]) for p in curve)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--quick", action="store_true", help="1 cycle of 128 sessions instead of 4 of 256, a 200-pair A/B"
    )
    parser.add_argument("--cycles", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None, help="simulated sessions per cycle (256; quick 128)")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task (GRPO group)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks (gates and the comparison)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens-per-turn", type=int, default=192)
    parser.add_argument("--trainer-config", default=None, help="trainer TOML (default: trainer/configs/default.toml)")
    parser.add_argument("--difficulty-mix", default=None, help="simulated requests' levels, e.g. 1:1 (the demo's)")
    parser.add_argument("--ab-pairs", type=int, default=None, help="fewest A/B (task, sample) pairs (400; quick 200)")
    parser.add_argument("--ab-tasks", type=int, default=None, help="A/B tasks (default: all at the mix's levels)")
    parser.add_argument("--curve-pairs", type=int, default=100, help="A/B pairs behind each curve point")
    parser.add_argument("--plot", default=None, help="where to draw the curve PNG (default: HOME/flywheel_curve.png)")
    parser.add_argument("--home", default=None, help="FLYWHEEL_HOME to use (resumes a run; default: a new one)")
    parser.add_argument("--keep", action="store_true", help="leave the stack running")
    args = parser.parse_args()
    cycles = args.cycles or (1 if args.quick else 4)
    sessions = args.sessions or (128 if args.quick else 256)
    eval_tasks = args.eval_tasks or HELD_OUT_TASKS
    ab_pairs = args.ab_pairs or (200 if args.quick else 400)
    # quick: 40 tasks x 5 samples, exactly the 200 pairs it needs (all 46 tasks would serve 230)
    ab_tasks_flag = args.ab_tasks or (40 if args.quick else None)
    trainer_lr = load_config(Path(args.trainer_config) if args.trainer_config else None).optim.lr

    home = Path(args.home or tempfile.mkdtemp(prefix="flywheel-bench-")).resolve()
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    os.environ["FLYWHEEL_HOME"] = str(home)

    mix = args.difficulty_mix or DEFAULT_DIFFICULTY_MIX
    ab_tasks = len(plan_pairs(ABConfig(tasks=ab_tasks_flag, samples=1, difficulty_mix=parse_mix(mix))))
    samples = math.ceil(ab_pairs / ab_tasks)
    curve_tasks = max(2, min(ab_tasks, math.ceil(args.curve_pairs / samples)))
    margin = load_gate_config().for_suite(SUITE).tolerance
    serving = ["--max-turns", str(args.max_turns), "--max-tokens-per-turn", str(args.max_tokens_per_turn)]
    ab_common = [*serving, "--max-tokens", str(args.max_turns * args.max_tokens_per_turn)]
    ab_common += ["--difficulty-mix", mix, "--samples", str(samples), "--json"]
    eval_budget = ["--max-turns", str(args.max_turns), "--max-tokens", str(args.max_tokens_per_turn)]
    steps: dict[str, float] = defaultdict(float)
    budget: dict[str, float] = defaultdict(float)
    started = time.monotonic()
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
            difficulty_mix=mix,
            timings=steps,
        )
        state = json.loads((home / "demo" / "state.json").read_text())
        first = state["candidate@1"]
        train = ["train", "--once", "--json", "--parent", "base", "--same-data-as", first, "--invert-reward"]
        train += [
            "--min-new",
            "1",
            "--lr",
            str(PLANTED_LR),
            "--max-steps",
            str(PLANTED_STEPS),
            "--max-kl-per-token",
            str(PLANTED_MAX_KL),
            "--no-progress",
            *(["--config", args.trainer_config] if args.trainer_config else []),
        ]
        planted = last_json(timed_flywheel(train, env, budget, "train"))["checkpoint_id"]
        gate_args = ["gate", planted, "--production", "base", "--suite", SUITE, "--gate-on", SUITE, "--samples", "1"]
        gate_args += ["--limit", str(eval_tasks), "--min-pairs", str(eval_tasks), *eval_budget, "--json"]
        gate = last_json(timed_flywheel(gate_args, env, budget, "gate"))

        get_settings.cache_clear()
        with session_scope() as session:
            final = get_production(session).id
            served = served_after_cycles(session, state, cycles)
        # In distribution: one A/B of base and the final checkpoint (base against itself when no
        # cycle was promoted: its second arm reuses the first's sessions).
        final_ab = ["ab", "base", final, "--tasks", str(ab_tasks), *ab_common]  # the draw planned above
        report = last_json(timed_flywheel(final_ab, env, budget, "ab"))
        in_distribution, signals_ab = ab_metrics(report)
        curve, measured = [], {}
        for point in served:
            ckpt = point["checkpoint"]
            if ckpt not in measured:  # the first curve_tasks tasks of the same draw: base and final are stored
                ab_args = ["ab", "base", ckpt, "--tasks", str(curve_tasks), *ab_common]
                measured[ckpt] = last_json(timed_flywheel(ab_args, env, budget, "curve"))
            m = measured[ckpt]["metrics"]
            curve.append(
                {
                    **point,
                    "pairs": measured[ckpt]["pairs"],
                    "pass_rate": m["pass_rate"]["final"],
                    "ci": m["pass_rate"]["final_ci"],
                    "diff_vs_base": m["pass_rate"]["diff"],
                    "diff_ci": m["pass_rate"]["ci"],
                    "signals": {n: m[n]["final"] for n in SIGNALS},
                }
            )
        plot = render_curve_png(
            plot_points(curve, measured), Path(args.plot) if args.plot else home / "flywheel_curve.png"
        )
        with session_scope() as session:
            held_out = paired(session, "base", final, SUITE) if final != "base" else None
            planted_held_out = paired(session, "base", planted, SUITE)
            budget["eval"] = eval_seconds(session)
            multi_segment = count_multi_segment_sessions(session)
    finally:
        if not args.keep:
            subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True)

    for step, seconds in steps.items():
        budget[PHASE_OF_STEP.get(step, step)] += seconds
    budget["gate"] = max(0.0, budget["gate"] - budget["eval"])  # the gate steps' time outside their evals
    # The planted regression must be refused on evidence (a "fail"): with the release policy below,
    # "insufficient_evidence" would let it through.
    rejected = gate.get("decision", "pass" if gate["passed"] else "fail") == "fail"
    if held_out is None:  # no candidate was promoted: the final checkpoint is base, paired with itself
        rate = planted_held_out.get("base")
        held_out = {
            "pairs": planted_held_out.get("pairs", 0),
            "base": rate,
            "final": rate,
            "diff": 0.0,
            "lower_bound": 0.0,
        }
    diff, lb = in_distribution["diff"] or 0.0, in_distribution["lower_bound"] or 0.0
    persistence_ci = signals_ab["edit_persistence"]["ci"]
    followup_ci = signals_ab["dissatisfied_followup_rate"]["ci"]
    if args.quick:
        ok = in_distribution["pairs"] >= 200 and diff > 0 and rejected
    else:
        ok = (
            diff >= 0.10
            and lb > 0
            and persistence_ci is not None
            and persistence_ci[0] > 0
            and followup_ci is not None
            and followup_ci[1] < 0
            and held_out["lower_bound"] > -margin
            and rejected
        )
    base_rate, final_rate = in_distribution["base"], in_distribution["final"]
    print(
        json.dumps(
            {
                "bench": "flywheel",
                "ours": final_rate,
                "baseline": base_rate,
                "unit": "fresh-traffic pass rate (training templates, unseen parameters)",
                "ratio": final_rate / base_rate if base_rate and final_rate is not None else None,
                "target": (
                    "in-distribution diff > 0 on >= 200 pairs, planted regression rejected"
                    if args.quick
                    else "in-distribution diff >= 0.10 (lower bound > 0), persistence up and follow-ups down "
                    "(95 % CI excludes 0), held-out lower bound > -margin, planted regression rejected"
                ),
                "in_distribution": in_distribution,
                "held_out": held_out,
                "signals_ab": signals_ab,
                "curve": curve,
                "budget_s": {k: round(v) for k, v in sorted(budget.items())},
                "margin": margin,
                "final_checkpoint": final,
                "planted_checkpoint": planted,
                "planted_rejected": rejected,
                "planted_decision": gate.get("decision"),
                "planted_failures": gate.get("failures"),
                "planted": {"lr": PLANTED_LR, "steps": PLANTED_STEPS, **planted_held_out},
                "release_policy": "promote on pass; insufficient evidence promoted with an audited override",
                "cycles": cycles,
                "sessions_per_cycle": sessions,
                "trainer_config": Path(args.trainer_config).name if args.trainer_config else "default.toml",
                "lr": trainer_lr,
                "multi_segment_sessions": multi_segment,
                "plot": str(plot),
                "difficulty_mix": mix,
                "wall_s": round(time.monotonic() - started),
                "home": str(home) if args.keep else None,
                "pass": ok,
            }
        )
    )


if __name__ == "__main__":
    main()

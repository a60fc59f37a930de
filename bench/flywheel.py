"""Does the flywheel learn what users care about? The deployed loop (``flywheel up``) for K cycles
from base on the real SmolLM2, then a paired A/B on fresh traffic.

One run, on a fresh embedded stack (its own ``FLYWHEEL_HOME``):

1. ``flywheel demo --cycles K`` drives the deployed loop: it starts ``flywheel up -d`` (the managed
   vLLM servers, the consumer, the API, the relay, the watcher, the Celery worker and beat) and
   sends simulated product traffic on the in-reach ``functions`` tasks; beat starts each training
   cycle once the cycle's traffic is finalized, the worker gates the candidate on the held-out
   ``functions`` suite (templates never trained on) and the release policy ``auto_on_pass``
   promotes it only if the gate passed; no override anywhere. ``--long-sessions S`` (default 0): a
   share S of each cycle's task groups plays long ``functions_long`` sessions, which self-summarize
   (``docs/tasks.md``); the A/B and the gates stay on ``functions``.
2. A planted regression and its control: from base, on cycle 1's data, one normal cycle at the
   trainer's default learning rate with the reward's sign flipped (``flywheel train --parent base
   --same-data-as C1 --invert-reward``), and the same cycle with the right sign; each gated against
   base on the same suite. The plant must fail the gate, its control must not.
3. Fresh traffic (``flywheel ab base FINAL``, ``ops/ab.py``): requests of kinds no cycle trained on
   (``functions`` ``fresh``, the A/B's default draw: production difficulty, each at least 3 code-skeleton
   tokens from every training task) at the production request mix, each
   (task, sample) served once by base and once by the final production checkpoint and answered by
   the same seeded simulated developer; pass rate and product signals with template-clustered 95 %
   intervals of the paired difference. Its sessions never reach the event stream.
4. Held out, on outcomes no gate chose by (``bench/evidence.py``): the report split
   (``functions_report``: held-out templates no cycle trains on and no gate reads), run on base, on
   every candidate, on the plant and its control and on the final production checkpoint at k samples
   (4) at the serving temperature; the paired difference against base, its 95 % interval and one-sided
   lower bound, clustered by template; the last candidate's beside production's. The gate suite's own
   comparison (the outcomes the gates chose production by) is reported apart, as ``gate_suite``.
5. The one-cycle contrast: from base on cycle 1's trajectories, true rewards against rewards shuffled
   within each task group, each arm at ``--one-cycle-twins`` trainer seeds (2; the plant's control is
   the true arm's twin at the trainer's seed), every twin on the report split.
6. The curve: after each cycle, the checkpoint production serves, on the first tasks of the same draw.

Every figure is read from the database the loop wrote (training cycles, gate decisions, promotions
with their actor, eval runs and results, stored A/B comparisons, session timestamps), never from a
command's printed output or the demo's state file.

Prints one JSON line: ``in_distribution`` (``pairs``, ``tasks``, ``samples``, ``base``, ``final``, ``diff``,
``ci``, ``lower_bound``; the A/B on the ``fresh`` split), ``fresh`` (the same with ``base`` read as the split's base
rate, ``base_in_target`` (15-35 %: a base that can move), ``min_skeleton_distance``), ``held_out`` (``split`` = report, ``suite``, ``gated`` = false, ``pairs``, ``samples``,
``cluster``, ``base``, ``final``, ``diff``, ``ci``, ``lower_bound``, ``last_candidate`` and ``candidates`` with
the same figures), ``gate_suite`` (the same comparison on the gated suite), ``one_cycle`` (``arms``: each
twin against base; ``twins``; ``true_vs_shuffled`` per seed; ``diff``; ``spread`` per arm and ``max``),
``signals_ab``, ``curve``, ``gate_decisions`` (per cycle: ``candidate``, ``decision``, ``power``,
``stopped_at_pairs``, ``promoted``, ``promoted_by``), ``planted`` and ``planted_control`` (``decision`` and the
held-out comparison with base), ``budget_s`` (seconds per phase from the database's timestamps),
``multi_segment_sessions`` (trajectories with more than one segment), ``seed``, ``placebo``, ``developer``
(the training traffic's noise knobs: ``--keeps-wrong-rate``, ``--untested-rate``, ``--signal-loss-rate``),
``gate_plan`` (the held-out gate's k, pairs, power and ``underpowered``: true under a ``--gate-samples`` below the
shipped plan's), ``placebo_mode`` (``within_group``, ``across_cycle`` or None), ``long_session_share``, ``release_policy``,
``wall_s``, ``pass``.

``pass``, default run: in-distribution ``diff >= 0.10`` with ``lower_bound > 0``, edit persistence up and dissatisfied
follow-ups down each with a 95 % interval excluding 0, held-out ``lower_bound > -margin``, the final checkpoint
promoted by the gate's pass, the plant failed and its control not failed. ``--quick``: at least 200 in-distribution
pairs, ``diff > 0``, the plant failed. A ``--placebo`` run (rewards shuffled within each task group of each cycle,
so each group's advantages keep their spread; ``--placebo across_cycle``: across the cycle) is a control: it
reports, and ``pass`` means the fresh-traffic interval includes 0.

Size: over 400 lines because the recipe (loop, plant, one-cycle twins, report split, A/B, curve, one JSON
line) reads top to bottom in ``main``; the evidence's helpers live in ``bench/evidence.py``.

Flags and their defaults: ``--help``; measured results: ``docs/benchmarks.md``; the store's read-outs:
``ops/loop_outcome.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

from pydantic import ValidationError

from app.core.db import session_scope
from app.core.pids import stop_pid
from app.core.settings import get_settings
from app.models.checkpoints import GateVerdict
from app.repositories.checkpoints import get_production
from bench.evidence import (
    REPORT_SUITE,
    flywheel,
    fresh_view,
    held_out_report,
    one_cycle_arms,
    one_cycle_contrast,
    run_report,
    train_from_base,
)
from evals.gate.policy import load_gate_config
from ops.ab import ABConfig, plan_pairs
from ops.demo import DEFAULT_DIFFICULTY_MIX, DemoOptions, min_new_trajectories, trainer_toml
from ops.demo_gate import gate_plan
from ops.demo_report import CURVE_SIGNALS, curve_point, render_curve_png
from ops.developer import DeveloperModel, developer_args
from ops.loop_outcome import (
    SUITE,
    ab_from_store,
    ab_metrics,
    gate_view,
    loop_budget,
    paired,
    served_after_cycles,
    succeeded_cycles,
)
from ops.processes import LOOP_SERVICES, SUPERVISOR, service_status
from ops.report import count_multi_segment_sessions
from ops.simulator_cli import parse_mix
from trainer.config import load_config

RELEASE_POLICY = "auto_on_pass"
PLACEBO_MODES = ("within_group", "across_cycle")  # trainer.config.DataConfig.placebo_mode


def plot_points(curve: list[dict], measured: dict[str, dict]) -> list[dict]:
    """The curve as :func:`ops.demo_report.render_curve_png` draws it: base first (cycle 0, from the
    first measured A/B's base arm), then each cycle's served checkpoint, each with its 95 % intervals."""
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


def stop_loop(home: Path) -> list[str]:
    """Stop the supervisor of ``flywheel up -d`` and the loop's processes (by pid); the vLLM servers,
    Postgres and the broker keep running. Returns what was stopped."""
    stopped = []
    for name, (pid, alive) in sorted(service_status(home).items(), key=lambda item: item[0] != SUPERVISOR):
        if alive and pid is not None and (name == SUPERVISOR or name in LOOP_SERVICES):
            stop_pid(pid)
            stopped.append(name)
    return stopped


def gate_against_base(env: dict[str, str], candidate: str, eval_budget: list[str], policy: Path | None) -> dict:
    """``flywheel gate CANDIDATE --production base`` on the held-out suite (under the gate policy file
    ``policy``, else the shipped one); the stored decision."""
    args = ["gate", candidate, "--production", "base", "--suite", SUITE, "--gate-on", SUITE, *eval_budget]
    args += ["--config", str(policy)] if policy else []
    subprocess.run([sys.executable, "-m", "ops.cli", *args], env=env)  # exit 1 is a failed gate: read the store
    with session_scope() as session:
        return gate_view(session, candidate)


def main() -> None:  # noqa: PLR0915 - one recipe, read top to bottom
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 cycle of 128 sessions, a 200-pair A/B")
    parser.add_argument("--cycles", type=int, default=None)
    parser.add_argument("--sessions", type=int, default=None, help="simulated sessions per cycle (256; quick 128)")
    parser.add_argument("--group-size", type=int, default=4, help="sessions per task (GRPO group)")
    parser.add_argument("--eval-tasks", type=int, default=None, help="held-out tasks of the gates (whole suite)")
    parser.add_argument("--max-turns", type=int, default=2)
    parser.add_argument("--max-tokens-per-turn", type=int, default=192)
    parser.add_argument("--trainer-config", default=None, help="trainer TOML (default: trainer/configs/default.toml)")
    parser.add_argument("--difficulty-mix", default=None, help="simulated requests' levels (the demo's)")
    parser.add_argument("--long-sessions", type=float, default=0.0, help="share of task groups played as long sessions")
    parser.add_argument("--ab-pairs", type=int, default=None, help="fewest A/B (task, sample) pairs (400; quick 200)")
    parser.add_argument("--ab-tasks", type=int, default=None, help="A/B tasks (default: all at the mix's levels)")
    parser.add_argument("--curve-pairs", type=int, default=100, help="A/B pairs behind each curve point")
    parser.add_argument("--seed", type=int, default=0, help="seeds the traffic, training order and the A/B draw")
    parser.add_argument(
        "--placebo",
        nargs="?",
        const="within_group",
        default=None,
        choices=PLACEBO_MODES,
        help="a control run: shuffle each cycle's rewards within each task group (within_group, the default "
        "with a bare --placebo) or across the cycle (across_cycle, the placebo before 2026-12-02)",
    )
    parser.add_argument(
        "--keeps-wrong-rate", type=float, default=0.0, help="share of plausible wrong edits the developer keeps"
    )
    parser.add_argument("--untested-rate", type=float, default=0.0, help="share of sessions whose tests it never runs")
    parser.add_argument("--signal-loss-rate", type=float, default=0.0, help="share of late signals that never arrive")
    parser.add_argument(
        "--report-samples", type=int, default=None, help="k of the report split (its suite's 4; quick 1)"
    )
    parser.add_argument(
        "--one-cycle-twins", type=int, default=None, help="trainer seeds per arm of the one-cycle contrast (2; quick 0)"
    )
    parser.add_argument(
        "--gate-samples",
        type=int,
        default=None,
        help="k of the held-out gate (the shipped 8); fewer fits the bench's time, and its JSON says underpowered",
    )
    parser.add_argument("--plot", default=None, help="where to draw the curve PNG (default: HOME/flywheel_curve.png)")
    parser.add_argument("--home", default=None, help="FLYWHEEL_HOME to use (resumes a run; default: a new one)")
    parser.add_argument("--keep", action="store_true", help="leave the loop running")
    args = parser.parse_args()
    if not 0.0 <= args.long_sessions <= 1.0:
        parser.error(f"--long-sessions is a share of the task groups, 0 to 1 (got {args.long_sessions})")
    try:  # the training traffic's developer (docs/simulator.md, "Noisier developers")
        developer = DeveloperModel(
            keeps_wrong_rate=args.keeps_wrong_rate,
            untested_rate=args.untested_rate,
            signal_loss_rate=args.signal_loss_rate,
        )
    except ValidationError as exc:
        parser.error(f"developer noise: {exc}")
    cycles = args.cycles or (1 if args.quick else 4)
    sessions = args.sessions or (128 if args.quick else 256)
    ab_pairs = args.ab_pairs or (200 if args.quick else 400)
    ab_tasks_flag = args.ab_tasks or (40 if args.quick else None)  # quick: 40 tasks x 5 samples
    if args.one_cycle_twins is None:
        args.one_cycle_twins = 0 if args.quick else 2
    if args.one_cycle_twins == 1:
        parser.error("--one-cycle-twins: at least 2 (a twin per arm shows run-to-run noise), or 0 for none")
    if args.report_samples is None and args.quick:
        args.report_samples = 1
    trainer = load_config(Path(args.trainer_config) if args.trainer_config else None)
    trainer_lr = trainer.optim.lr

    home = Path(args.home or tempfile.mkdtemp(prefix="flywheel-bench-")).resolve()
    env = {**os.environ, "FLYWHEEL_HOME": str(home)}
    os.environ["FLYWHEEL_HOME"] = str(home)
    mix = args.difficulty_mix or DEFAULT_DIFFICULTY_MIX
    ab_tasks = len(plan_pairs(ABConfig(tasks=ab_tasks_flag, samples=1, difficulty_mix=parse_mix(mix))))
    samples = math.ceil(ab_pairs / ab_tasks)
    curve_tasks = max(2, min(ab_tasks, math.ceil(args.curve_pairs / samples)))
    margin = load_gate_config().for_suite(SUITE).margin
    budget = ["--max-turns", str(args.max_turns), "--max-tokens-per-turn", str(args.max_tokens_per_turn)]
    ab_common = [*budget, "--max-tokens", str(args.max_turns * args.max_tokens_per_turn)]
    ab_common += ["--difficulty-mix", mix, "--samples", str(samples), "--seed", str(args.seed), "--json"]
    eval_budget = ["--max-turns", str(args.max_turns), "--max-tokens", str(args.max_tokens_per_turn)]
    report_budget = list(eval_budget)  # the report split runs whole: --eval-tasks sizes the gates only
    if args.eval_tasks:
        eval_budget += ["--limit", str(args.eval_tasks), "--min-pairs", str(args.eval_tasks)]
    started = time.monotonic()
    phase: dict[str, float] = defaultdict(float)
    try:
        demo = ["demo", "--cycles", str(cycles), "--sessions", str(sessions), "--group-size", str(args.group_size)]
        demo += ["--source", SUITE, "--suite", SUITE, *budget, "--eval-max-turns", str(args.max_turns)]
        demo += ["--difficulty-mix", mix, "--ab-tasks", "0", "--seed", str(args.seed)]
        demo += ["--release-policy", RELEASE_POLICY, "--cycle-timeout", "5400"]
        demo += [*(["--eval-tasks", str(args.eval_tasks)] if args.eval_tasks else [])]
        demo += [*(["--gate-samples", str(args.gate_samples)] if args.gate_samples else [])]
        demo += [*(["--trainer-config", args.trainer_config] if args.trainer_config else [])]
        demo += [*(["--placebo", "--placebo-mode", args.placebo] if args.placebo else [])]
        demo += ["--long-sessions", str(args.long_sessions)]
        demo += developer_args(developer)
        t0 = time.monotonic()
        flywheel(demo, env)
        phase["loop"] = time.monotonic() - t0
        # The loop's cycles are done: its processes stop (the servers and the stack stay), so no
        # scheduled cycle races the bench's own plant for the training lock.
        stop_loop(home)
        get_settings.cache_clear()
        with session_scope() as session:
            # the loop's cycles: each trained on at least the demo's batch minimum (a straggler's cycle would not)
            scheduled = succeeded_cycles(session, min_trajectories=min_new_trajectories(DemoOptions(sessions=sessions)))
            candidates = [c.checkpoint_id for c in scheduled][:cycles]
        t0 = time.monotonic()
        # the cycles' segment length with long sessions (ops.demo.trainer_toml), never their --placebo
        plant = DemoOptions(trainer_config=args.trainer_config, long_session_share=args.long_sessions)
        plant_config = str(trainer_toml(plant, home / "plant")) if args.long_sessions else args.trainer_config
        planted = train_from_base(env, candidates[0], invert=True, trainer_config=plant_config)
        control = train_from_base(env, candidates[0], invert=False, trainer_config=plant_config)
        phase["plant_train"] = time.monotonic() - t0
        t0 = time.monotonic()
        # one cycle from base on cycle 1's trajectories: true against shuffled rewards, twins by trainer
        # seed; the plant's control is the true arm's twin at the trainer's own seed
        seeds = [trainer.seed + i for i in range(args.one_cycle_twins)]
        arms = one_cycle_arms(env, candidates[0], seeds, plant_config, {trainer.seed: control})
        phase["one_cycle_train"] = time.monotonic() - t0
        t0 = time.monotonic()
        policy, plan_of_gate = gate_plan(home, None, args.gate_samples, args.eval_tasks)
        planted_gate = gate_against_base(env, planted, eval_budget, policy)
        control_gate = gate_against_base(env, control, eval_budget, policy)
        phase["plant_gate"] = time.monotonic() - t0

        with session_scope() as session:
            final = get_production(session).id
            served = served_after_cycles(session, candidates)
        t0 = time.monotonic()  # the report split: no gate reads it
        twins = [c for arm in arms.values() for c in arm.values()]
        run_report(env, [*candidates, final, planted, control, *twins], report_budget, args.report_samples)
        phase["report"] = time.monotonic() - t0
        t0 = time.monotonic()
        flywheel(["ab", "base", final, "--tasks", str(ab_tasks), "--label", "bench-final", *ab_common], env)
        phase["ab"] = time.monotonic() - t0
        t0 = time.monotonic()
        measured: dict[str, dict] = {}
        for point in served:
            ckpt = point["checkpoint"]
            if ckpt not in measured:  # the first curve_tasks tasks of the same draw: base and final reused
                label = f"bench-curve-{ckpt}"
                flywheel(["ab", "base", ckpt, "--tasks", str(curve_tasks), "--label", label, *ab_common], env)
                with session_scope() as session:
                    measured[ckpt] = ab_from_store(session, label)
        phase["curve"] = time.monotonic() - t0
        with session_scope() as session:
            in_distribution, signals_ab = ab_metrics(ab_from_store(session, "bench-final"))
            held_out = held_out_report(session, final, candidates)
            gate_suite = {"suite": SUITE, **paired(session, "base", final, SUITE, by_template=True)}
            one_cycle = one_cycle_contrast(session, candidates[0], arms) if args.one_cycle_twins else None
            planted_held_out = paired(session, "base", planted, SUITE, by_template=True)
            control_held_out = paired(session, "base", control, SUITE, by_template=True)
            planted_report = paired(session, "base", planted, REPORT_SUITE, by_template=True)
            control_report = paired(session, "base", control, REPORT_SUITE, by_template=True)
            loop_phases = loop_budget(session)
            multi_segment = count_multi_segment_sessions(session)
        curve = [
            {
                **p,
                "pairs": measured[p["checkpoint"]]["pairs"],
                "pass_rate": measured[p["checkpoint"]]["metrics"]["pass_rate"]["final"],
                "ci": measured[p["checkpoint"]]["metrics"]["pass_rate"]["final_ci"],
                "diff_vs_base": measured[p["checkpoint"]]["metrics"]["pass_rate"]["diff"],
                "diff_ci": measured[p["checkpoint"]]["metrics"]["pass_rate"]["ci"],
            }
            for p in served
        ]
        plot = render_curve_png(
            plot_points(curve, measured), Path(args.plot) if args.plot else home / "flywheel_curve.png"
        )
    finally:
        if not args.keep:
            subprocess.run([sys.executable, "-m", "ops.cli", "demo", "--down"], env=env, capture_output=True)

    diff, lb = in_distribution["diff"] or 0.0, in_distribution["lower_bound"] or 0.0
    persistence_ci = (signals_ab.get("edit_persistence") or {}).get("ci")
    followup_ci = (signals_ab.get("dissatisfied_followup_rate") or {}).get("ci")
    planted_failed = planted_gate["decision"] == GateVerdict.FAIL
    control_held = control_gate["decision"] != GateVerdict.FAIL
    final_by_gate = final == "base" or any(
        p["candidate"] == final and p["decision"] == GateVerdict.PASS for p in served
    )
    if args.placebo:
        ok = in_distribution["ci"] is not None and in_distribution["ci"][0] <= 0 <= in_distribution["ci"][1]
    elif args.quick:
        ok = in_distribution["pairs"] >= 200 and diff > 0 and planted_failed
    else:
        ok = (
            diff >= 0.10
            and lb > 0
            and persistence_ci is not None
            and persistence_ci[0] > 0
            and followup_ci is not None
            and followup_ci[1] < 0
            and held_out["lower_bound"] > -margin
            and final != "base"
            and final_by_gate
            and planted_failed
            and control_held
        )
    base_rate, final_rate = in_distribution["base"], in_distribution["final"]
    print(
        json.dumps(
            {
                "bench": "flywheel",
                "ours": final_rate,
                "baseline": base_rate,
                "unit": "fresh-traffic pass rate (the A/B's split: kinds of request no cycle trained on)",
                "ratio": final_rate / base_rate if base_rate and final_rate is not None else None,
                "target": (
                    "placebo: fresh-traffic interval includes 0"
                    if args.placebo
                    else "in-distribution diff > 0 on >= 200 pairs, the plant failed by the gate"
                    if args.quick
                    else "in-distribution diff >= 0.10 (lower bound > 0), persistence up and follow-ups down "
                    "(95 % CI excludes 0), held-out lower bound > -margin, the final checkpoint promoted by a "
                    "gate pass, the plant failed and its control not"
                ),
                "in_distribution": in_distribution,
                "fresh": fresh_view(in_distribution),
                "held_out": held_out,
                "gate_suite": gate_suite,
                "one_cycle": one_cycle,
                "signals_ab": signals_ab,
                "curve": curve,
                "gate_decisions": served,
                "budget_s": {k: round(v) for k, v in sorted({**loop_phases, **phase}.items())},
                "margin": margin,
                "gate_plan": plan_of_gate.as_dict(),
                "final_checkpoint": final,
                "planted": {
                    "checkpoint": planted,
                    "lr": trainer_lr,
                    **planted_gate,
                    **planted_held_out,
                    "report": planted_report,
                },
                "planted_control": {
                    "checkpoint": control,
                    "lr": trainer_lr,
                    **control_gate,
                    **control_held_out,
                    "report": control_report,
                },
                "planted_rejected": planted_failed,
                "release_policy": f"{RELEASE_POLICY}, no override",
                "seed": args.seed,
                "placebo": args.placebo is not None,
                "placebo_mode": args.placebo,
                "developer": developer.model_dump(
                    include={"keeps_wrong_rate", "untested_rate", "signal_loss_rate", "late_signal_rate"}
                ),
                "cycles": cycles,
                "sessions_per_cycle": sessions,
                "trainer_config": Path(args.trainer_config).name if args.trainer_config else "default.toml",
                "lr": trainer_lr,
                "multi_segment_sessions": multi_segment,
                "long_session_share": args.long_sessions,
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

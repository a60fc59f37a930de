"""Power and false-rejection rate of the promotion gate at a grid of suite sizes (tasks x samples).

The gate (``evals.gate.decision.decide_gate``, the shipped ``evals/gate.toml`` policy for ``--suite``) fails
a candidate when the one-sided lower confidence bound of pass@1(candidate) - pass@1(production)
(the shipped interval: Newcombe's paired score interval, with k > 1 samples the wider of it and the
task-clustered paired bootstrap) is at or below ``-margin`` (the non-inferiority margin); below
its power rule (``min_power``) it does not pass either (``insufficient_evidence``), and ``passed``
below counts passes only. This bench asks, for each (T tasks, k samples per task):

- *false rejection* (FRR): how often it fails a candidate exactly as good as production;
- *power*: how often it fails a candidate ``--regression`` (5) points worse.

Per-task pass probabilities: a Beta(a, b) fitted by maximum likelihood (beta-binomial) to per-task
pass counts, either the measured table shipped in ``bench/data/smollm2_functions_pass.json``
(SmolLM2-135M-Instruct on sixteen one-line function requests at T = 0.7, written by
``bench/passk_table.py``) or, with ``--from-db [RUN_ID ...]``, the stored ``eval_result`` rows of
those runs (default: every succeeded run of ``--suite``). Each simulated gate draws T tasks' p from
the Beta; production and the candidate each sample k Bernoulli outcomes per task independently (no
coupling through the shared sampling seed, so this is the conservative case: correlated samples
only narrow the interval). The worse candidate's tasks are shifted on the *logit* scale,
``q = expit(logit(p) - s)``, with one ``s`` solved so the population mean drops by exactly the
regression (easy tasks stay easy, none leaves [0, 1]). Every simulated pair of runs goes through
``decide_gate`` itself; its ``passed`` gives the figures at the configured margin, and its
``diff_low`` (the bound) gives the range of margins that would meet both targets at that size:
``FRR <= 0.05`` needs ``margin >= -q05(bound | equal)``; ``power >= 0.8`` needs
``margin <= -q80(bound | worse)``.

Chosen default: the cheapest cell (fewest sessions T*k, then more tasks) whose margins meeting
both targets (on a 0.5-point grid) span at least ``--min-width`` (1 point: a cell that meets them at
a single margin is within the simulation's Monte Carlo error of failing), and the middle of those
margins, to be written to ``evals/gate.toml`` (docs/gate.md). The grid table also shows power and
FRR at the configured margin. Eval wall time per checkpoint = T*k sessions x seconds per session (measured
from the stored runs with ``--from-db``, else ``--seconds-per-session``, flagged as not measured).

JSON line: ours = power at the chosen size and margin, baseline = FRR there, ratio = power / 0.8,
target 0.8 (and FRR <= 0.05); pass when both hold. Without any cell and margin meeting both, the
largest cell at the configured margin is reported and pass is false. Simulated gates use 2,000
bootstrap replicates (the shipped policy: 10,000), which moves each bound only by Monte Carlo noise.

Flags: ``--quick`` (fewer simulations, resamples and cells), ``--suite NAME`` (its gate settings in
``evals/gate.toml``), ``--from-db [RUN_ID ...]``, ``--table JSON`` (per-task counts), ``--regression X``
(0.05), ``--mean X`` (move the fitted Beta's mean, keeping its concentration), ``--tasks N ...``,
``--samples K ...``, ``--sims N``, ``--seconds-per-session S``, ``--concurrency N`` (sessions in flight;
wall time divides by it), ``--resamples N``, ``--max-sessions N`` (2,624), ``--min-width X`` (0.01),
``--seed N``. Measured results: ``docs/gate.md``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path

import numpy as np
from scipy import optimize, special, stats
from sqlalchemy import func, select

from app.core.db import session_scope
from app.models import EvalResult, EvalRun
from evals.gate.decision import decide_gate
from evals.gate.models import Outcome, SuiteOutcomes
from evals.gate.policy import GateConfig, SuiteGate, load_gate_config

TARGET_POWER = 0.8
TARGET_FRR = 0.05
TABLE = Path(__file__).parent / "data" / "smollm2_functions_pass.json"
SESSION_S_FLAG = 14.0
"""Seconds per eval session when not measured: issue 29's demo (4 tasks per suite at ~14 s each)."""


def fit_beta(counts: list[tuple[int, int]]) -> tuple[float, float]:
    """Maximum-likelihood Beta(a, b) of per-task pass probabilities from ``(n, c)`` counts
    (beta-binomial likelihood, ``scipy.stats.betabinom``).

    Raises:
        ValueError: no counts.
    """
    if not counts:
        raise ValueError("no per-task counts to fit")
    n = np.array([x[0] for x in counts])
    c = np.array([x[1] for x in counts])

    def nll(theta: np.ndarray) -> float:
        a, b = np.exp(theta)
        return -float(stats.betabinom.logpmf(c, n, a, b).sum())

    res = optimize.minimize(nll, x0=np.zeros(2), method="Nelder-Mead", options={"xatol": 1e-6, "fatol": 1e-9})
    a, b = np.exp(res.x)
    return float(a), float(b)


def logit_shift(a: float, b: float, regression: float) -> float:
    """The logit shift ``s`` with ``E[expit(logit(p) - s)] = E[p] - regression`` for p ~ Beta(a, b).

    Raises:
        ValueError: the mean pass rate is not above the regression (no such shift).
    """
    grid = stats.beta.ppf((np.arange(4000) + 0.5) / 4000, a, b).clip(1e-9, 1 - 1e-9)
    target = grid.mean() - regression
    if target <= 0:
        raise ValueError(f"mean pass rate {grid.mean():.3f} is not above the regression {regression}")
    return float(optimize.brentq(lambda s: special.expit(special.logit(grid) - s).mean() - target, 0.0, 50.0))


def one_gate(
    rng: np.random.Generator, p: np.ndarray, q: np.ndarray, k: int, suite: str, config: GateConfig
) -> tuple[bool, float]:
    """Sample ``k`` outcomes per task for production (``p``) and the candidate (``q``) and decide.

    Returns:
        (gate passed, the lower bound of the pass@1 difference it compared with ``-margin``).
    """
    prod = rng.random((len(p), k)) < p[:, None]
    cand = rng.random((len(q), k)) < q[:, None]
    keys = [(f"t{t:04d}", s) for t in range(len(p)) for s in range(k)]
    c_out = [Outcome(t, s, bool(x)) for (t, s), x in zip(keys, cand.ravel())]
    p_out = [Outcome(t, s, bool(x)) for (t, s), x in zip(keys, prod.ravel())]
    r = decide_gate(
        {suite: SuiteOutcomes(suite, "sim", c_out, planned=keys)},
        {suite: SuiteOutcomes(suite, "sim", p_out, planned=keys)},
        config,
    )
    return r.passed, float(r.suites[suite].diff_low)


def simulate_cell(
    tasks: int, k: int, a: float, b: float, shift: float, sims: int, suite: str, config: GateConfig, seed: int
) -> dict[str, float]:
    """FRR and power of one (tasks, samples) cell over ``sims`` simulated gates per hypothesis."""
    rng = np.random.default_rng([seed, tasks, k])
    eq_pass, eq_low, w_pass, w_low = [], [], [], []
    for _ in range(sims):
        p = rng.beta(a, b, tasks)
        ok, low = one_gate(rng, p, p, k, suite, config)
        eq_pass.append(ok)
        eq_low.append(low)
        ok, low = one_gate(rng, p, special.expit(special.logit(np.clip(p, 1e-9, 1 - 1e-9)) - shift), k, suite, config)
        w_pass.append(ok)
        w_low.append(low)
    frr = 1.0 - float(np.mean(eq_pass))
    power = 1.0 - float(np.mean(w_pass))
    return {
        "tasks": tasks,
        "samples": k,
        "sessions": tasks * k,
        "frr": frr,
        "power": power,
        "tol_min": -float(np.quantile(eq_low, TARGET_FRR)),
        "tol_max": -float(np.quantile(w_low, TARGET_POWER)),
        "eq_low": np.array(eq_low),
        "w_low": np.array(w_low),
    }


def at_margin(cell: dict, tol: float) -> tuple[float, float]:
    """(power, FRR) of a cell had the suite's margin been ``tol``: the gate's non-inferiority check
    fails exactly when its lower bound is at or below ``-tol`` (``evals.gate.decision._evaluate_suite``)."""
    return float(np.mean(cell["w_low"] <= -tol)), float(np.mean(cell["eq_low"] <= -tol))


def recommend(cells: list[dict], min_width: float) -> tuple[dict, float] | None:
    """The cheapest cell (fewest sessions, then more tasks) whose margins meeting power >= 0.8
    and FRR <= 0.05 (on a 0.5-point grid) span at least ``min_width``, so the choice survives the
    simulation's Monte Carlo error and a small drift of production's pass rates; the margin is
    the middle of that span. None when no cell has one."""
    grid = [t / 200 for t in range(1, 41)]  # 0.005 .. 0.2
    for cell in sorted(cells, key=lambda c: (c["sessions"], -c["tasks"])):
        good = [t for t in grid if (lambda pw, fr: pw >= TARGET_POWER and fr <= TARGET_FRR)(*at_margin(cell, t))]
        if good and good[-1] - good[0] >= min_width - 1e-9:
            return cell, good[len(good) // 2]
    return None


def counts_from_db(suite: str, run_ids: list[str]) -> tuple[list[tuple[int, int]], float | None, str]:
    """Per-task ``(n, c)`` of stored runs (every succeeded run of ``suite`` when ``run_ids`` is
    empty), seconds per session measured from those runs (wall time / results), and a description."""
    with session_scope() as session:
        q = select(EvalRun)
        q = (
            q.where(EvalRun.id.in_([uuid.UUID(r) for r in run_ids]))
            if run_ids
            else q.where(EvalRun.suite == suite, EvalRun.status == "succeeded")
        )
        runs = session.scalars(q).all()
        if not runs:
            raise SystemExit(f"no stored eval runs for {run_ids or suite!r}")
        rows = session.execute(
            select(EvalResult.run_id, EvalResult.task_id, func.count(), func.count().filter(EvalResult.passed))
            .where(EvalResult.run_id.in_([r.id for r in runs]))
            .group_by(EvalResult.run_id, EvalResult.task_id)
        ).all()
        wall = sum((r.finished_at - r.started_at).total_seconds() for r in runs if r.finished_at)
        done = sum(n for _, _, n, _ in rows)
    counts = [(int(n), int(c)) for _, _, n, c in rows]
    return counts, (wall / done if done and wall > 0 else None), f"{len(runs)} stored runs, {done} results"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer simulations, resamples and cells")
    ap.add_argument("--suite", default="functions", help="gate settings of this suite (evals/gate.toml)")
    ap.add_argument(
        "--from-db",
        nargs="*",
        metavar="RUN_ID",
        default=None,
        help="fit to stored eval results (these runs, or every succeeded run of --suite)",
    )
    ap.add_argument("--table", type=Path, default=TABLE, help="measured per-task counts (JSON)")
    ap.add_argument("--regression", type=float, default=0.05, help="regression to detect (pass-rate fraction)")
    ap.add_argument(
        "--mean",
        type=float,
        default=None,
        help="move the fitted Beta's mean here, keeping its concentration a + b (a suite without "
        "stored results whose production pass rate is known from elsewhere)",
    )
    ap.add_argument("--tasks", type=int, nargs="+", default=None)
    ap.add_argument("--samples", type=int, nargs="+", default=None)
    ap.add_argument("--sims", type=int, default=None, help="simulated gates per cell and hypothesis")
    ap.add_argument(
        "--seconds-per-session",
        type=float,
        default=None,
        help=f"eval seconds per session (default: measured with --from-db, else {SESSION_S_FLAG})",
    )
    ap.add_argument("--concurrency", type=int, default=1, help="sessions in flight (wall time divides by it)")
    ap.add_argument(
        "--resamples",
        type=int,
        default=None,
        help="bootstrap replicates per simulated gate (default 2000, --quick 1000; the shipped "
        "policy's 10,000 only moves each bound by Monte Carlo noise)",
    )
    ap.add_argument("--max-sessions", type=int, default=2624, help="skip cells with more sessions (164 x 16)")
    ap.add_argument(
        "--min-width",
        type=float,
        default=0.01,
        help="the chosen size's margins meeting both targets must span this much (1 point)",
    )
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    tasks = args.tasks or ([64, 164] if args.quick else [64, 100, 164, 256, 400])
    samples = args.samples or ([1, 4, 8] if args.quick else [1, 2, 4, 8, 16])
    sims = args.sims or (100 if args.quick else 200)
    shipped = load_gate_config()
    config = shipped.model_copy(
        update={
            "suites": {args.suite: shipped.suites.get(args.suite, SuiteGate())},
            "bootstrap_resamples": min(args.resamples or (1000 if args.quick else 2000), shipped.bootstrap_resamples),
        }
    )
    tol = config.for_suite(args.suite).margin

    measured_s = None
    if args.from_db is not None:
        counts, measured_s, source = counts_from_db(args.suite, args.from_db)
    else:
        table = json.loads(args.table.read_text())
        counts = [tuple(v) for v in table["tasks"].values()]
        source = (
            f"{args.table.name}: {table['model']}, {len(counts)} tasks, T={table['temperature']} "
            f"({table['generated_by']})"
        )
    session_s = args.seconds_per_session or measured_s or SESSION_S_FLAG
    session_src = (
        "--seconds-per-session"
        if args.seconds_per_session
        else "measured from the stored runs"
        if measured_s
        else f"NOT MEASURED: flag {SESSION_S_FLAG} s (issue 29 demo)"
    )
    a, b = fit_beta(counts)
    if args.mean is not None:
        source += f"; mean moved to {args.mean} (concentration {a + b:.3f} kept)"
        a, b = args.mean * (a + b), (1 - args.mean) * (a + b)
    try:
        shift = logit_shift(a, b, args.regression)
    except ValueError as exc:
        raise SystemExit(f"{exc}: a suite that cannot lose {args.regression:.0%} has no power to size") from None
    n_all, c_all = sum(n for n, _ in counts), sum(c for _, c in counts)
    print(
        f"per-task pass probabilities: {source}; {c_all}/{n_all} passed; Beta(a={a:.3f}, b={b:.3f}) "
        f"mean {a / (a + b):.3f}; regression {args.regression:.0%} = logit shift {shift:.3f}",
        file=sys.stderr,
    )
    print(
        f"gate: {config.method}, {config.confidence:.0%} {'two' if config.two_sided else 'one'}-sided, "
        f"margin {tol:.3f} (suite {args.suite}), {config.bootstrap_resamples} resamples; {sims} gates per "
        f"cell and hypothesis; {session_s:.2f} s per session ({session_src}), concurrency {args.concurrency}",
        file=sys.stderr,
    )
    print(
        f"{'tasks':>6} {'k':>3} {'sessions':>8} {'power':>7} {'FRR':>6} {'tol range meeting both':>24} "
        f"{'wall/ckpt':>10}",
        file=sys.stderr,
    )
    started = time.perf_counter()
    cells = []
    for t in tasks:
        for k in samples:
            if t * k > args.max_sessions:
                continue
            cell = simulate_cell(t, k, a, b, shift, sims, args.suite, config, args.seed)
            cell["wall_s"] = cell["sessions"] * session_s / args.concurrency
            cells.append(cell)
            lo, hi = cell["tol_min"], cell["tol_max"]
            rng_txt = f"[{lo:.3f}, {hi:.3f}]" if lo <= hi else "none"
            print(
                f"{t:>6} {k:>3} {cell['sessions']:>8} {cell['power']:>7.3f} {cell['frr']:>6.3f} {rng_txt:>24} "
                f"{cell['wall_s'] / 60:>8.1f} m",
                file=sys.stderr,
                flush=True,
            )
    best = recommend(cells, args.min_width)
    if best is not None:
        chosen, chosen_tol = best
    else:
        chosen, chosen_tol = max(cells, key=lambda c: c["sessions"]), tol
    power, frr = at_margin(chosen, chosen_tol)
    passed = power >= TARGET_POWER and frr <= TARGET_FRR
    mc_se = float(np.sqrt(max(power * (1 - power), frr * (1 - frr), 0.01) / sims))
    print(
        f"chosen: {chosen['tasks']} tasks x {chosen['samples']} samples = {chosen['sessions']} sessions at "
        f"margin {chosen_tol:.3f}{'' if chosen_tol == tol else f' (configured {tol:.3f})'}: power {power:.3f}, "
        f"FRR {frr:.3f} (Monte Carlo s.e. ~{mc_se:.3f}); eval wall time {chosen['wall_s'] / 60:.1f} min per "
        f"checkpoint; {time.perf_counter() - started:.0f} s simulated",
        file=sys.stderr,
    )
    print(
        json.dumps(
            {
                "bench": "gate_power",
                "ours": round(power, 4),
                "baseline": round(frr, 4),
                "unit": "power at a 5-point regression (baseline: false-rejection rate of an equal candidate)",
                "ratio": round(power / TARGET_POWER, 4),
                "target": TARGET_POWER,
                "frr_target": TARGET_FRR,
                "pass": passed,
                "suite": args.suite,
                "tasks": chosen["tasks"],
                "samples_per_task": chosen["samples"],
                "margin": chosen_tol,
                "configured_margin": tol,
                "regression": args.regression,
                "beta": [round(a, 4), round(b, 4)],
                "seconds_per_session": session_s,
                "seconds_per_session_source": session_src,
                "eval_wall_s": round(chosen["wall_s"], 1),
                "sims": sims,
                "quick": args.quick,
            }
        )
    )


if __name__ == "__main__":
    main()

"""Throughput of the sandboxed grader next to a bare subprocess loop, on HumanEval reference solutions.

For each HumanEval task the workdir holds the task's files with the reference solution applied
(what a perfect agent would leave behind). *Ours* grades it with
:func:`evals.harness.agent.grade` (hidden tests copied in, run in the sandbox with limits) from a
thread pool of 1 and of 2 workers, as the eval runner does. The *baseline* runs the very same test
command on the very same files with a plain ``subprocess.run`` in a serial loop (no sandbox, no
limits). Both must pass every task, so the comparison is of the same checks. Rounds alternate
(bare, 1 worker, 2 workers) and the median round counts, which damps noise on a shared machine.

Reports tasks/s of each, the sandbox's overhead (1 worker vs bare) and the parallel speedup (2
workers vs 1). Ends with one JSON line: ours = sandboxed tasks/s with 2 workers, baseline = bare
loop tasks/s. Target 0.9: isolation (fresh uid, copy, rlimits, network namespace, group kill, sweep)
may cost a single sandbox about 2x, and two parallel sandboxes must win back all but 10 % of it,
so grading never becomes the runner's bottleneck next to generation.

Flags: ``--quick`` (12 tasks, 1 round), ``--tasks N`` (40), ``--rounds N`` (3), ``--timeout S`` (30).
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from evals.config import load_suite
from evals.harness.agent import grade
from evals.runner import _harness_args
from evals.tasks import load_tasks

TARGET = 0.9


def prepare(task, root: Path) -> Path:
    """A workdir holding the task's files with the reference solution applied."""
    d = Path(tempfile.mkdtemp(prefix="ref-", dir=root))
    for name, text in {**task.files, **task.reference_files}.items():
        p = d / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return d


def bare_check(task, workdir: Path, timeout_s: float) -> bool:
    """The same hidden test, without the sandbox: copy the test files in, run the command."""
    for name, text in task.test_files.items():
        p = workdir / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    proc = subprocess.run(task.test_command, shell=True, cwd=workdir, capture_output=True, timeout=timeout_s)
    return proc.returncode == 0


def timed(fn, tasks, workers: int, root: Path) -> tuple[float, int]:
    """(tasks/s, passed) grading every task with ``fn(task, workdir)`` on ``workers`` threads."""
    dirs = [prepare(t, root) for t in tasks]
    start = time.perf_counter()
    with ThreadPoolExecutor(max_workers=workers) as pool:
        passed = sum(pool.map(fn, tasks, dirs))
    elapsed = time.perf_counter() - start
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    return len(tasks) / elapsed, passed


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="12 tasks, 1 round")
    parser.add_argument("--tasks", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=30.0)
    args = parser.parse_args(argv)
    n, rounds = (12, 1) if args.quick else (args.tasks, args.rounds)

    tasks = load_tasks("humaneval", "test", limit=n, seed=0)
    suite = load_suite("humaneval")
    suite = suite.model_copy(update={"grading": suite.grading.model_copy(update={"timeout_s": args.timeout})})
    _, _, limits = _harness_args(suite, seed=0)
    root = Path(tempfile.mkdtemp(prefix="bench-eval-"))
    results: dict[str, list[float]] = {"bare": [], "sandbox_1": [], "sandbox_2": []}
    try:
        for _ in range(rounds):
            for name, fn, workers in (
                ("bare", lambda t, d: bare_check(t, d, args.timeout), 1),
                ("sandbox_1", lambda t, d: grade(t, d, limits), 1),
                ("sandbox_2", lambda t, d: grade(t, d, limits), 2),
            ):
                rate, passed = timed(fn, tasks, workers, root)
                if passed != len(tasks):
                    print(f"{name}: only {passed}/{len(tasks)} reference solutions passed", file=sys.stderr)
                    return 1
                results[name].append(rate)
                print(f"{name:<10} {rate:6.2f} tasks/s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    med = {k: statistics.median(v) for k, v in results.items()}
    ratio = med["sandbox_2"] / med["bare"]
    print(
        json.dumps(
            {
                "bench": "eval",
                "ours": round(med["sandbox_2"], 3),
                "baseline": round(med["bare"], 3),
                "unit": "tasks/s",
                "ratio": round(ratio, 3),
                "target": TARGET,
                "pass": ratio >= TARGET,
                "sandbox_1_worker": round(med["sandbox_1"], 3),
                "sandbox_overhead": round(med["bare"] / med["sandbox_1"], 3),
                "parallel_speedup": round(med["sandbox_2"] / med["sandbox_1"], 3),
                "tasks": len(tasks),
                "rounds": rounds,
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

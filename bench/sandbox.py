"""The sandbox's cost: a session's test run in the bubblewrap sandbox against the same run unsandboxed.

Set-up: ``--tasks`` tasks of ``--source`` (``functions``, train split; ``dataframebench`` imports
pandas, a heavier start), each written with its reference solution and hidden tests into a fresh
folder. Each round runs every task's ``test_command`` twice, in alternating order:

- *ours*: ``evals.harness.sandbox.run_in_sandbox`` (bwrap namespaces; as root a fresh uid and a
  copy of the folder synced back; the audit hook in every Python process; the source's allow-listed
  environment; the run's own cgroup where the host delegates one, ``containment`` in the line);
- *baseline*: the same command as a plain ``subprocess.run`` in the folder (same minimal
  environment, no namespaces, no hook, no copy).

The median round counts (a shared two-core machine is noisy). Also measured: the absolute start
cost, ``true`` through the sandbox minus ``true`` as a plain subprocess (milliseconds).

Ends with ONE JSON line: ours = mean seconds per sandboxed test run, baseline = unsandboxed; target
ratio <= 1.3 (ours / baseline); ``start_cost_ms`` = the sandbox's fixed cost per run.

Flags: ``--quick`` (4 tasks, 3 rounds), ``--tasks N`` (12), ``--rounds N`` (5), ``--source NAME``.
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
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

from evals.config import source_packages
from evals.harness.sandbox import SandboxLimits, run_in_sandbox
from evals.harness.sandbox_bwrap import sandbox_env
from evals.harness.workspace import write_files
from evals.tasks import load_tasks

TARGET = 1.3


def plain_env() -> dict[str, str]:
    """The sandbox's environment without its hook (the unsandboxed side)."""
    env = {k: v for k, v in sandbox_env().items() if not k.startswith("SANDBOX_") and k != "PYTHONPATH"}
    return {**env, "HOME": tempfile.gettempdir(), "MPLCONFIGDIR": tempfile.gettempdir()}


def timed_plain(cmd: str, cwd: Path) -> float:
    t0 = time.perf_counter()
    proc = subprocess.run(["/bin/bash", "-c", cmd], cwd=cwd, env=plain_env(), capture_output=True, timeout=120)
    if proc.returncode != 0:
        raise RuntimeError(f"unsandboxed run failed in {cwd}: {proc.stderr[-500:]!r}")
    return time.perf_counter() - t0


def timed_sandbox(cmd: str, cwd: Path, limits: SandboxLimits) -> float:
    t0 = time.perf_counter()
    r = run_in_sandbox(cmd, cwd, limits)
    if not r.ok:
        raise RuntimeError(f"sandboxed run failed in {cwd}: {r.observation(500)}")
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--tasks", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--source", default="functions")
    args = ap.parse_args()
    n_tasks, rounds = (4, 3) if args.quick else (args.tasks, args.rounds)
    tasks = load_tasks(args.source, "train", limit=n_tasks, seed=0)
    limits = SandboxLimits(timeout_s=120, packages=source_packages(args.source))  # the suites' allow-list
    root = Path(tempfile.mkdtemp(prefix="flywheel-bench-sandbox-"))
    try:
        dirs = []
        for i, task in enumerate(tasks):
            d = root / f"task-{i}"
            d.mkdir()
            write_files(d, {**task.files, **task.reference_files, **task.test_files})
            dirs.append((task.test_command, d))
        containment = run_in_sandbox("true", root / "task-0", limits).containment  # also builds the environment
        start_ours = [timed_sandbox("true", root / "task-0", limits) for _ in range(10)]
        start_base = [timed_plain("true", root / "task-0") for _ in range(10)]
        ours_rounds, base_rounds = [], []
        for r in range(rounds):
            ours = base = 0.0
            for cmd, d in dirs:
                if r % 2:
                    base += timed_plain(cmd, d)
                    ours += timed_sandbox(cmd, d, limits)
                else:
                    ours += timed_sandbox(cmd, d, limits)
                    base += timed_plain(cmd, d)
            ours_rounds.append(ours / len(dirs))
            base_rounds.append(base / len(dirs))
            print(f"round {r}: sandbox {ours_rounds[-1]:.3f} s, plain {base_rounds[-1]:.3f} s", file=sys.stderr)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    ours_s, base_s = statistics.median(ours_rounds), statistics.median(base_rounds)
    ratio = ours_s / base_s
    print(
        json.dumps(
            {
                "bench": "sandbox",
                "ours": round(ours_s, 4),
                "baseline": round(base_s, 4),
                "unit": "s per test run",
                "ratio": round(ratio, 3),
                "target": TARGET,
                "pass": ratio <= TARGET,
                "start_cost_ms": round(1000 * (statistics.median(start_ours) - statistics.median(start_base)), 1),
                "start_ms": {
                    "sandbox_true": round(1000 * statistics.median(start_ours), 1),
                    "plain_true": round(1000 * statistics.median(start_base), 1),
                },
                "containment": containment,
                "source": args.source,
                "tasks": len(dirs),
                "rounds": rounds,
            }
        )
    )


if __name__ == "__main__":
    main()

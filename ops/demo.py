"""``flywheel demo``: the whole loop once, on the embedded stack, resumable.

Steps (each skipped when its effect is already in the database or the checkpoint store, so an
interrupted demo picks up where it stopped):

1. stack      embedded Postgres + Kafka-compatible broker, migrations
2. model      SmolLM2-135M-Instruct materialized and registered as production checkpoint ``base``
3. services   the ingest consumer, the promotion API and the outbox relay as background processes
4. simulate   editor sessions on DataFrameBench *train* tasks, events through ``EventProducer``
5. finalize   wait until every trajectory is finalized (late signals or the window)
6. train      one training cycle -> a candidate checkpoint
7. gate       evals of candidate and production on held-out DataFrameBench *test* and HumanEval tasks,
              then the gate decision
8. release    as a release manager, through the promotion API: promote if the gate passed,
              else reject
9. report     terminal + HTML + PNG under ``$FLYWHEEL_HOME/reports/demo/``

Every step runs the same ``flywheel`` command a user would run, as a subprocess, so the demo
exercises the production code paths and their own progress bars.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.errors import FlywheelError, InfrastructureError
from app.core.settings import flywheel_home, get_settings

STEPS = ("stack", "model", "services", "simulate", "finalize", "train", "gate", "release", "report")


@dataclass
class DemoOptions:
    """Knobs of the demo. Defaults finish in about 15 minutes on 2 CPU cores."""

    sessions: int = 8
    group_size: int = 4
    max_turns: int = 3
    max_tokens: int = 160
    train_steps: int = 4
    eval_tasks: int = 4
    humaneval_tasks: int = 4
    finalize_window_s: float = 5.0
    trace: bool = False
    model_dir: str | None = None
    seed: int = 0


class DemoState:
    """Progress of the demo, in ``$FLYWHEEL_HOME/demo/state.json`` (mode 0600: it holds a token)."""

    def __init__(self, home: Path) -> None:
        self.path = home / "demo" / "state.json"
        self.data: dict[str, Any] = json.loads(self.path.read_text()) if self.path.exists() else {"done": []}

    def done(self, step: str) -> bool:
        return step in self.data["done"]

    def mark(self, step: str, **values: Any) -> None:
        if step not in self.data["done"]:
            self.data["done"].append(step)
        self.data.update(values)
        self.save()

    def save(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.write_text(json.dumps(self.data, indent=2))
        self.path.chmod(0o600)


def _env(opts: DemoOptions) -> dict[str, str]:
    env = dict(os.environ)
    env["FLYWHEEL_HOME"] = str(flywheel_home())
    env["FLYWHEEL_FINALIZE_WINDOW"] = str(opts.finalize_window_s)
    if opts.trace:
        env["FLYWHEEL_TELEMETRY_EXPORTER"] = "console"
    return env


def flywheel(args: list[str], opts: DemoOptions, *, capture: bool = False, check: bool = True,
             timeout_s: float | None = None) -> subprocess.CompletedProcess[str]:
    """Run ``flywheel ARGS`` as a subprocess (same interpreter), streaming its output.

    Raises:
        FlywheelError: the command failed (its exit code and, when captured, its stderr).
    """
    cmd = [sys.executable, "-m", "app.cli", *args]
    proc = subprocess.run(cmd, env=_env(opts), text=True, timeout=timeout_s,
                          capture_output=capture)
    if check and proc.returncode != 0:
        detail = (proc.stderr or "")[-2000:] if capture else ""
        raise FlywheelError(f"`flywheel {' '.join(args)}` exited with {proc.returncode}\n{detail}")
    return proc

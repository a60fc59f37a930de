"""``flywheel demo``: the deployed loop (``flywheel up``) on the embedded stack, driven by simulated
product traffic for ``--cycles N`` cycles, then a report. Resumable; ``--down`` stops everything.

The demo is a client of the loop, as a product backend and an observer would be; it trains, gates
and promotes nothing itself. Its steps (each skipped when its effect is recorded in
``$FLYWHEEL_HOME/demo/state.json``, so an interrupted demo continues where it stopped):

1. ``stack``   embedded Postgres + the Kafka-protocol broker, migrations (``flywheel stack up``)
2. ``model``   ``--model-dir`` registered as production ``base`` (else ``flywheel up`` materializes SmolLM2)
3. ``up``      ``flywheel up -d`` on a compressed schedule (:func:`loop_env`): a training cycle as soon as a
               cycle's traffic is finalized, the held-out gate on every candidate (its plan printed first:
               UNDERPOWERED under ``--gate-samples`` below the shipped k), the release policy ``auto_on_pass``
               (a candidate the gate passes is promoted, audited as the policy; one it fails or cannot
               decide is held), the watcher reloading the production vLLM server
4. per cycle: ``simulate`` (sessions through ``flywheel simulate``, the product backend's path; ``--long-sessions
   S``: a share S of the task groups long ``functions_long`` sessions), ``decide`` (wait until the loop has
   trained, gated and released the cycle's candidate, and the production server serves what the database says
   is production), ``measure`` (the checkpoint now serving against base on fresh traffic: a point of the curve)
5. ``report``  terminal + HTML + PNG under ``$FLYWHEEL_HOME/reports/demo/`` (``ops.demo_report``)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from app.core.db import session_scope
from app.core.errors import FlywheelError
from app.core.migrate import upgrade
from app.core.net import free_port, served_weight_version
from app.core.settings import flywheel_home, get_settings
from evals.harness.agent import AgentBudget
from ops import loop_state
from ops.demo_gate import gate_plan, smaller_gate_file
from ops.demo_report import curve_point, write_demo_report
from ops.developer import DeveloperModel, developer_args
from ops.simulator import PRODUCTION_MIX, SimulatorConfig
from ops.stack import stack_down, stack_up
from trainer.config import load_config

TRAINER_DEFAULT = Path(__file__).resolve().parents[1] / "trainer" / "configs" / "default.toml"

# The simulated request mix of the in-reach source by difficulty level (ops.simulator.PRODUCTION_MIX):
# mostly one-expression requests, the level where group-relative RL has signal.
DEFAULT_DIFFICULTY_MIX = ",".join(f"{level}:{weight}" for level, weight in PRODUCTION_MIX.items())
# A cycle starts once every session of the batch left its trajectory, or once none was finalized and no
# open session sent an event for QUIET_S seconds (trainer.selection.trajectories_waiting): privacy-mode
# sessions (10 % by default) and sessions the simulator could not serve leave none, so it usually ends a batch.
QUIET_S = 20.0
# The trainer's segment length when the traffic has long sessions (``--long-sessions``): a segment
# holds the context the simulator keeps (3,072 tokens) plus its summary turn (the request, about 50
# tokens, and the summary). The default ``data.max_seq_len`` (2,048) is below a long session's first
# prompt (2,087-2,324 tokens), so truncated there a long segment keeps no sampled token and the
# trainer leaves its trajectory out (``no_completion_tokens``).
LONG_SEGMENT_TOKENS = SimulatorConfig().context_tokens + AgentBudget().summary_tokens + 256


@dataclass
class DemoOptions:
    """Knobs of the demo (``flywheel demo --help``)."""

    cycles: int = 3
    sessions: int = 16
    group_size: int = 4
    source: str = "functions"
    difficulty_mix: str | None = DEFAULT_DIFFICULTY_MIX
    max_turns: int = 3
    max_tokens_per_turn: int = 160
    long_session_share: float = 0.0  # share of task groups played as long functions_long sessions
    train_max_steps: int | None = None
    trainer_config: str | None = None
    eval_tasks: int | None = None  # held-out tasks the gate runs (None: the whole suite)
    eval_suites: tuple[str, ...] = ("functions",)
    gate_config: str | None = None  # gate policy TOML (default evals/gate.toml)
    gate_samples: int | None = None  # k of the held-out gate (None: the policy's); fewer is underpowered, and says so
    placebo: str | None = None  # a control run: rewards shuffled, "within_group" (each task group) or "across_cycle"
    developer: DeveloperModel = field(default_factory=DeveloperModel)  # the training traffic's developer noise
    eval_max_turns: int = 2
    eval_max_tokens: int = 160
    finalize_window_s: float = 10.0
    trace: bool = False
    model_dir: str | None = None
    seed: int = 0
    cycle_timeout_s: float = 1800.0
    ab_tasks: int = 24  # fresh-traffic tasks of each curve point
    ab_samples: int = 2  # sessions per task and arm of each curve point
    release_policy: str = "auto_on_pass"
    override_insufficient: str | None = None  # written reason: the policy promotes insufficient evidence too


class DemoState:
    """Progress of the demo, in ``$FLYWHEEL_HOME/demo/state.json``."""

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
        self.path.write_text(json.dumps(self.data, indent=2, default=str))
        self.path.chmod(0o600)


def min_new_trajectories(opts: DemoOptions) -> int:
    """The fewest trajectories a scheduled cycle trains on: a quarter of a cycle's sessions (at
    least 1). A batch leaves about 90 % of its sessions as trajectories (privacy mode leaves none),
    so it always trains; the few stragglers finalized after their batch's cycle selected its data
    are fewer, so they wait for the next batch (``train-when-ready`` does not start a cycle below
    this) instead of training a candidate of their own."""
    return max(1, opts.sessions // 4)


def trainer_toml(opts: DemoOptions, home: Path) -> Path:
    """The trainer config of the loop's scheduled cycles: ``--trainer-config`` (default
    ``trainer/configs/default.toml``) with the demo's step budget, training on a cycle's traffic
    (``min_new_trajectories``: :func:`min_new_trajectories`), with shuffled rewards under
    ``--placebo`` (within each task group by default), and segments up to
    :data:`LONG_SEGMENT_TOKENS` long where the traffic has long sessions."""
    path = home / "demo" / "trainer.toml"
    base = Path(opts.trainer_config).resolve() if opts.trainer_config else TRAINER_DEFAULT
    lines = [f"extends = {json.dumps(str(base))}"]
    if opts.train_max_steps:
        lines.append(f"max_steps = {opts.train_max_steps}")
    lines += ["", "[data]", f"min_new_trajectories = {min_new_trajectories(opts)}"]
    if opts.long_session_share > 0 and load_config(base).data.max_seq_len < LONG_SEGMENT_TOKENS:
        lines.append(f"max_seq_len = {LONG_SEGMENT_TOKENS}")
    if opts.placebo:
        lines += ["placebo = true", f"placebo_mode = {json.dumps(opts.placebo)}"]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    return path


def loop_env(opts: DemoOptions, home: Path, api_port: int) -> dict[str, str]:
    """The environment of the demo's ``flywheel up``: the production settings, on a schedule
    compressed from hours to the demo's minutes (see the module docstring)."""
    env = dict(os.environ)
    env["FLYWHEEL_HOME"] = str(home)
    env["FLYWHEEL_API_PORT"] = str(api_port)
    # Late signals arrive within seconds in the simulator: a short window finalizes in minutes.
    env.setdefault("FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S", str(opts.finalize_window_s))
    env.setdefault("FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S", "2")
    env.setdefault("FLYWHEEL_CONSUMER_FINALIZE_GRACE_S", "1")
    env["FLYWHEEL_TRAIN_READY_TRAJECTORIES"] = str(opts.sessions)
    env["FLYWHEEL_TRAIN_READY_QUIET_S"] = str(QUIET_S)
    env["FLYWHEEL_TRAIN_CHECK_INTERVAL"] = "5"
    env["FLYWHEEL_TRAIN_INTERVAL"] = str(30 * 24 * 3600)  # the cycles start when their traffic is in
    env["FLYWHEEL_TRAIN_CONFIG"] = str(trainer_toml(opts, home))
    env["FLYWHEEL_EVAL_SCAN_INTERVAL"] = "20"
    # No mining: the simulated traffic plays a fixed pool of training tasks, and a task mined from it
    # would be held out of the very cycles the demo and the bench measure.
    env.setdefault("FLYWHEEL_EVAL_MINE_INTERVAL", "0")
    env["FLYWHEEL_EVAL_GATE_ON"] = json.dumps(list(opts.eval_suites))
    if policy := smaller_gate_file(home, opts.gate_config, opts.gate_samples, opts.eval_tasks) or opts.gate_config:
        env["FLYWHEEL_EVAL_GATE_CONFIG"] = str(Path(policy).resolve())
    env["FLYWHEEL_EVAL_MAX_TURNS"] = str(opts.eval_max_turns)
    env["FLYWHEEL_EVAL_MAX_TOKENS_PER_TURN"] = str(opts.eval_max_tokens)
    if opts.eval_tasks:
        env["FLYWHEEL_EVAL_LIMIT"] = str(opts.eval_tasks)
        env["FLYWHEEL_EVAL_MIN_PAIRS"] = str(opts.eval_tasks)
    env["FLYWHEEL_RELEASE_POLICY"] = opts.release_policy
    if opts.override_insufficient:
        env["FLYWHEEL_RELEASE_OVERRIDE_INSUFFICIENT"] = opts.override_insufficient
    if opts.trace:
        env["FLYWHEEL_TELEMETRY_EXPORTER"] = "console"
    return env


def flywheel(
    args: list[str], env: dict[str, str], *, capture: bool = False, timeout_s: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``flywheel ARGS`` as a subprocess (same interpreter), streaming its output.

    Raises:
        FlywheelError: the command failed (its exit code and, when captured, its stderr).
    """
    cmd = [sys.executable, "-m", "ops.cli", *args]
    proc = subprocess.run(cmd, env=env, text=True, timeout=timeout_s, capture_output=capture)
    if proc.returncode != 0:
        detail = (proc.stderr or "")[-2000:] if capture else ""
        raise FlywheelError(f"`flywheel {' '.join(args)}` exited with {proc.returncode}\n{detail}")
    return proc


def session_budget_args(opts: DemoOptions) -> list[str]:
    """The request mix and per-session budgets, as ``flywheel simulate`` and ``flywheel ab`` take them
    (the curve's fresh traffic is served like the production traffic the cycle trained on)."""
    return [
        *(["--difficulty-mix", opts.difficulty_mix] if opts.difficulty_mix else []),
        "--max-turns", str(opts.max_turns),
        "--max-tokens-per-turn", str(opts.max_tokens_per_turn),
        "--max-tokens", str(opts.max_turns * opts.max_tokens_per_turn),
    ]  # fmt: skip


@dataclass
class Demo:
    """One demo run: its options, progress, home and the environment of the loop it drives."""

    opts: DemoOptions
    state: DemoState
    home: Path

    @property
    def env(self) -> dict[str, str]:
        if "api_port" not in self.state.data:
            self.state.data["api_port"] = free_port()
            self.state.save()
        return loop_env(self.opts, self.home, self.state.data["api_port"])

    # ---- setup ---------------------------------------------------------------------------------

    def step_stack(self) -> str:
        """Start (or reuse) the embedded stack and migrate."""
        st = stack_up(self.home)
        get_settings.cache_clear()
        upgrade(url=st.database_url)
        return f"postgres {st.database_url}, kafka {st.kafka_bootstrap}"

    def step_model(self) -> str:
        """Register ``--model-dir`` as production ``base`` (default: ``up`` materializes SmolLM2)."""
        with session_scope() as session:
            production = loop_state.production_id(session)
        if production or not self.opts.model_dir:
            return f"production is {production}" if production else "the loop materializes the base model"
        flywheel(["model", "register", self.opts.model_dir, "--id", "base", "--status", "production"], self.env)
        return "registered base as production"

    def step_up(self) -> str:
        """``flywheel up -d``: the loop's processes and vLLM servers, supervised in the background."""
        flywheel(["up", "--detach"], self.env)
        return f"the loop is up (API http://127.0.0.1:{self.state.data['api_port']})"

    # ---- one cycle ----------------------------------------------------------------------------

    def step_simulate(self, cycle: int) -> str:
        """Simulated editor sessions through the serving front on train tasks (those not yet run)."""
        key = f"since@{cycle}"
        with session_scope() as session:
            if key not in self.state.data:  # the cycle's traffic is what starts after this point
                m = loop_state.mark(session)
                self.state.data[key] = {"seq": m.seq, "at": m.at.isoformat()}
                self.state.save()
            done = loop_state.sessions_since(session, self._mark(cycle))
        remaining = self.opts.sessions - done
        if remaining <= 0:
            return f"{done} sessions already simulated"
        args = ["simulate", "--sessions", str(remaining), "--group-size", str(min(self.opts.group_size, remaining))]
        args += ["--source", self.opts.source, *session_budget_args(self.opts)]
        if self.opts.long_session_share > 0:  # the A/B's fresh traffic stays on --source
            args += ["--long-sessions", str(self.opts.long_session_share)]
        args += developer_args(self.opts.developer)
        args += ["--seed", str(self.opts.seed + 1000 * cycle + done)]
        flywheel(args, self.env)
        return f"{remaining} sessions simulated"

    def step_decide(self, cycle: int) -> str:
        """Wait until the loop trained, gated and released the cycle's candidate, and the production
        server serves production."""
        since = self._mark(cycle)
        deadline = time.monotonic() + self.opts.cycle_timeout_s
        with Progress(transient=True) as progress:
            bar = progress.add_task("the loop: finalize, train, gate, release", total=None)
            while True:
                with session_scope() as session:
                    stored, finalized = loop_state.trajectories_since(session, since)
                    cycles = loop_state.cycles_since(session, since)
                    done = [c.checkpoint_id for c in cycles if c.status == "succeeded" and c.checkpoint_id]
                    cand = loop_state.candidate_state(session, done[0]) if done else None
                    production = loop_state.production_id(session)
                progress.update(bar, description=self._progress_line(stored, finalized, cycles, cand))
                if cand is not None and cand.settled and self._serving() == production:
                    self.state.data[f"candidate@{cycle}"] = cand.checkpoint_id
                    self.state.save()
                    verb = "promoted" if cand.status == "production" else f"held ({cand.status})"
                    return (
                        f"candidate {cand.checkpoint_id}: gate {cand.decision}, {verb}; production serves {production}"
                    )
                failed = [c for c in cycles if c.status == "failed"]
                if failed:
                    raise FlywheelError(f"training cycle {failed[0].id} failed: {failed[0].detail[:500]}")
                if time.monotonic() > deadline:
                    raise FlywheelError(
                        f"cycle {cycle} not decided after {self.opts.cycle_timeout_s:.0f}s "
                        f"({self._progress_line(stored, finalized, cycles, cand)}); "
                        f"see {self.home / 'logs'} (worker.log, beat.log, watcher.log)"
                    )
                time.sleep(2.0)

    def step_measure(self, cycle: int) -> str:
        """The checkpoint now serving against base on fresh production traffic: a point of the curve."""
        with session_scope() as session:
            production, base = loop_state.production_id(session), loop_state.base_id(session)
        if self.opts.ab_tasks < 2 or production is None:
            return "skipped (no production checkpoint)" if production is None else "skipped (--ab-tasks 0)"
        args = ["ab", base or production, production, "--tasks", str(self.opts.ab_tasks)]
        args += ["--samples", str(self.opts.ab_samples), *session_budget_args(self.opts)]
        args += ["--seed", str(self.opts.seed), "--label", f"cycle-{cycle}", "--json"]
        proc = flywheel(args, self.env, capture=True)
        point = curve_point(cycle, json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1]))
        self.state.data[f"curve@{cycle}"] = point
        self.state.save()
        lo, hi = point["pass_rate_ci"] or (None, None)
        interval = f" [{lo:.0%}, {hi:.0%}]" if lo is not None else ""
        return (
            f"{production}: fresh-traffic pass rate {point['pass_rate']:.0%}{interval} over {point['pairs']} sessions"
        )

    def step_report(self) -> str:
        """Terminal report plus HTML and PNG under ``$FLYWHEEL_HOME/reports/demo``, with the curve."""
        curve = [
            self.state.data[f"curve@{c}"] for c in range(1, self.opts.cycles + 1) if f"curve@{c}" in self.state.data
        ]
        out = get_settings().store.reports() / "demo"
        return f"report: {write_demo_report(out, self.state.data.get(f'candidate@{self.opts.cycles}'), curve)}"

    # ---- helpers --------------------------------------------------------------------------------

    def _mark(self, cycle: int) -> loop_state.Mark:
        raw = self.state.data[f"since@{cycle}"]
        return loop_state.Mark(seq=int(raw["seq"]), at=datetime.fromisoformat(raw["at"]))

    def _serving(self) -> str | None:
        serving = get_settings().serving
        key = serving.api_key.get_secret_value() if serving.api_key else None
        return served_weight_version(serving.url, api_key=key) if serving.url else None

    @staticmethod
    def _progress_line(stored: int, finalized: int, cycles: list, cand: loop_state.CandidateState | None) -> str:
        if cand is not None:
            return f"candidate {cand.checkpoint_id}: {cand.status}, gate {cand.decision or 'running'}"
        skipped = sum(c.status == "skipped" for c in cycles)
        return f"{finalized}/{stored} trajectories finalized" + (f", {skipped} cycle(s) skipped" if skipped else "")


def run_demo(opts: DemoOptions) -> None:
    """Run every step not yet done (see the module docstring).

    Raises:
        FlywheelError: a step failed; re-running continues from that step.
    """
    home = flywheel_home()
    demo = Demo(opts, DemoState(home), home)
    con = Console()
    started = time.monotonic()
    con.print(gate_plan(home, opts.gate_config, opts.gate_samples, opts.eval_tasks)[1].rich_line())
    plan: list[tuple[str, str, Callable[..., str], int | None]] = [
        ("stack", "stack", demo.step_stack, None),
        ("model", "model", demo.step_model, None),
        ("up", "up", demo.step_up, None),
    ]
    for c in range(1, opts.cycles + 1):
        for name, fn in (
            ("simulate", demo.step_simulate),
            ("decide", demo.step_decide),
            ("measure", demo.step_measure),
        ):
            plan.append((f"{name}@{c}", f"{name} (cycle {c}/{opts.cycles})", fn, c))
    plan.append(("report", "report", demo.step_report, None))
    always = {"stack", "up", "report"}  # processes die with the machine; reports are cheap
    for i, (key, label, fn, cycle) in enumerate(plan, 1):
        where = f"[{i}/{len(plan)}] {label}"
        if demo.state.done(key) and key not in always:
            con.print(f"[dim]{where}: done earlier[/]")
            continue
        t0 = time.monotonic()
        con.print(f"[bold cyan]{where}[/]: {' '.join((fn.__doc__ or '').split(chr(10) * 2)[0].split())}")
        get_settings.cache_clear()
        summary = fn() if cycle is None else fn(cycle)
        demo.state.mark(key)
        con.print(f"    {summary} [dim]({time.monotonic() - t0:.0f}s)[/]")
    con.print(
        f"[bold green]demo finished in {time.monotonic() - started:.0f}s[/]; "
        "the loop keeps running: `flywheel demo --down` stops everything it started"
    )


def stop_demo() -> list[str]:
    """Stop every process the demo (and the stack) started."""
    return stack_down()

"""``flywheel demo``: the whole loop, ``--cycles N`` times, on the embedded stack, resumable.

Steps (each skipped when its effect is already recorded, so an interrupted demo picks up where it
stopped; the five cycle steps run once per cycle, each cycle from the production checkpoint the
previous one left):

1. stack      embedded Postgres + Kafka-compatible broker, migrations
2. model      SmolLM2-135M-Instruct materialized and registered as production checkpoint ``base``
3. serving    the managed vLLM servers (production traffic, evals) on the production checkpoint,
              warming up while the next step runs (``--engine torch``: in-process engines instead)
3. services   the ingest consumer, the promotion API, the outbox relay and the serving watcher
              (promotions reach the production server through the lifecycle topic) in the background
4. simulate   editor sessions served by production on *train* tasks, events through ``EventProducer``
5. finalize   wait until every trajectory is finalized (late signals or the window)
6. train      one training cycle -> a candidate checkpoint
7. gate       evals of candidate and production on held-out tasks, then the gate decision
8. release    as a release manager, through the promotion API: promote if the gate passed,
              else reject (a gate that found insufficient evidence, as the demo's few eval
              tasks give, is not overridden: the demo does not promote what it cannot show)
10. report    terminal + HTML + PNG under ``$FLYWHEEL_HOME/reports/demo/``, with learning curves
              across the cycles (``ops.curves``) and which way the product signals moved

Every step runs the same ``flywheel`` command a user would run, as a subprocess, so the demo
exercises the production code paths and their own progress bars.

Size: over 400 lines because it is one recipe: the setup and cycle steps share ``DemoOptions``,
``DemoState`` and the subprocess helper, and each step reads best beside the ones it hands over to.
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

import httpx
import matplotlib
import matplotlib.pyplot as plt
from rich.console import Console
from rich.progress import Progress
from rich.table import Table
from sqlalchemy import text

from app.core.db import session_scope
from app.core.errors import FlywheelError
from app.core.migrate import upgrade
from app.core.net import free_port
from app.core.settings import flywheel_home, get_settings
from ops.processes import start_service, wait_http
from ops.report import write_report
from ops.stack import serving_up, serving_wait, stack_down, stack_up
from serving.engine import resolve_checkpoint
from serving.vllm_server import auth_headers

SETUP_STEPS = ("stack", "model", "serving", "services")
CYCLE_STEPS = ("simulate", "finalize", "train", "gate", "release", "measure")
CURVE_SIGNALS = ("edit_persistence", "dissatisfied_followup_rate", "mean_completion_tokens")


# The simulated request mix of the in-reach source by difficulty level (docs/simulator.md): mostly
# one-expression requests, which the base model solves about a quarter of the time at the serving
# temperature, the level where group-relative RL has signal; levels 2 and 3 it almost never solves.
DEFAULT_DIFFICULTY_MIX = "1:0.6,2:0.3,3:0.1"


@dataclass
class DemoOptions:
    """Knobs of the demo. Defaults finish in 4 to 7 minutes on 2 CPU cores (README)."""

    cycles: int = 3
    sessions: int = 16
    group_size: int = 4
    source: str = "functions"
    difficulty_mix: str | None = DEFAULT_DIFFICULTY_MIX
    max_turns: int = 3
    max_tokens_per_turn: int = 160
    train_max_steps: int | None = None
    trainer_config: str | None = None
    eval_tasks: int = 4
    eval_suites: tuple[str, ...] = ()
    eval_samples: int = 1
    eval_max_turns: int = 2
    eval_max_tokens: int = 160
    finalize_window_s: float = 10.0
    trace: bool = False
    model_dir: str | None = None
    seed: int = 0
    finalize_timeout_s: float = 300.0
    engine: str = "vllm"  # vllm: managed vLLM servers; torch: the in-process engine
    ab_tasks: int = 24  # fresh-traffic tasks of each curve point
    override_insufficient: str | None = None  # a release manager's written reason to promote over insufficient evidence
    ab_samples: int = 2  # sessions per task and arm of each curve point


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
    # Late signals (edit persistence, follow-ups) arrive within seconds in the simulator; a short
    # window lets the demo finalize trajectories in minutes rather than the production hour.
    env.setdefault("FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S", str(opts.finalize_window_s))
    env.setdefault("FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S", "2")
    env.setdefault("FLYWHEEL_CONSUMER_FINALIZE_GRACE_S", "1")
    if opts.trace:
        env["FLYWHEEL_TELEMETRY_EXPORTER"] = "console"
    if opts.engine == "torch":  # over a stack.env that names vLLM servers
        env["FLYWHEEL_SERVING_ENGINE"] = "torch"
    return env


def flywheel(
    args: list[str], opts: DemoOptions, *, capture: bool = False, check: bool = True, timeout_s: float | None = None
) -> subprocess.CompletedProcess[str]:
    """Run ``flywheel ARGS`` as a subprocess (same interpreter), streaming its output.

    Raises:
        FlywheelError: the command failed (its exit code and, when captured, its stderr).
    """
    cmd = [sys.executable, "-m", "ops.cli", *args]
    proc = subprocess.run(cmd, env=_env(opts), text=True, timeout=timeout_s, capture_output=capture)
    if check and proc.returncode != 0:
        detail = (proc.stderr or "")[-2000:] if capture else ""
        raise FlywheelError(f"`flywheel {' '.join(args)}` exited with {proc.returncode}\n{detail}")
    return proc


def _db_scalar(sql: str, **params: Any) -> Any:
    with session_scope() as session:
        return session.execute(text(sql), params).scalar()


def step_stack(opts: DemoOptions, state: DemoState, home: Path) -> str:
    """Start (or reuse) the embedded stack and migrate."""
    st = stack_up()
    get_settings.cache_clear()
    upgrade(url=st.database_url)
    port = state.data.get("api_port") or free_port()
    state.data["api_port"] = port
    state.save()
    return f"postgres {st.database_url}, kafka {st.kafka_bootstrap}"


def step_model(opts: DemoOptions, state: DemoState, home: Path) -> str:
    """Materialize SmolLM2-135M-Instruct (or register ``--model-dir``) as production ``base``."""
    production = _db_scalar("SELECT id FROM checkpoint WHERE status = 'production'")
    if production:
        return f"production is {production}"
    if opts.model_dir:
        flywheel(["model", "register", opts.model_dir, "--id", "base", "--status", "production"], opts)
    else:
        flywheel(["model", "init"], opts)
    return "registered base as production"


def step_serving(opts: DemoOptions, state: DemoState, home: Path) -> str:
    """The managed vLLM servers (production, eval) on the production checkpoint, warming up."""
    if opts.engine != "vllm":
        return f"engine {opts.engine}: each command loads its own in-process engine"
    cid, path = resolve_checkpoint(None, None)
    urls = serving_up(cid, path, home, wait=False)
    return ", ".join(f"{role} {url}" for role, url in urls.items()) + " (warming up)"


def step_services(opts: DemoOptions, state: DemoState, home: Path) -> str:
    """The consumer, the promotion API, the outbox relay and the serving watcher in the background."""
    env = _env(opts)
    env["FLYWHEEL_API_PORT"] = str(state.data["api_port"])
    started = {
        "consumer": start_service("consumer", ["consume"], home, env),
        "api": start_service("api", ["api", "--port", str(state.data["api_port"])], home, env),
        "relay": start_service("relay", ["relay"], home, env),
    }
    wait_http(f"http://127.0.0.1:{state.data['api_port']}/healthz")
    if opts.engine == "vllm":
        t0 = time.monotonic()
        serving_wait(home)
        started["watcher"] = start_service("watcher", ["watch"], home, _env(opts))
        return (
            ", ".join(f"{k} pid {v}" for k, v in started.items())
            + f"; vLLM ready after {time.monotonic() - t0:.0f}s more"
        )
    return ", ".join(f"{k} pid {v}" for k, v in started.items())


def wait_serving_production(timeout_s: float = 120.0) -> str:
    """Wait until the production vLLM server serves the production checkpoint (the watcher moves it
    after a promotion). Returns its id.

    Raises:
        FlywheelError: it still serves another checkpoint after ``timeout_s`` seconds (see
            ``logs/watcher.log``).
    """
    production = _db_scalar("SELECT id FROM checkpoint WHERE status = 'production'")
    url = get_settings().serving.url
    deadline = time.monotonic() + timeout_s
    served = None
    while time.monotonic() < deadline:
        try:
            served = httpx.get(f"{url}/weight_info", headers=auth_headers(), timeout=5).json().get("weight_version")
        except httpx.HTTPError:
            served = None
        if served == production:
            return production
        time.sleep(1.0)
    raise FlywheelError(
        f"the production server serves {served}, not production {production}, after {timeout_s:.0f}s; "
        "see logs/watcher.log"
    )


def session_budget_args(opts: DemoOptions) -> list[str]:
    """The request mix and per-session budgets, as ``flywheel simulate`` and ``flywheel ab`` take them
    (the curve's fresh traffic is served like the production traffic the cycle trained on)."""
    return [
        *(["--difficulty-mix", opts.difficulty_mix] if opts.difficulty_mix else []),
        "--max-turns", str(opts.max_turns),
        "--max-tokens-per-turn", str(opts.max_tokens_per_turn),
        "--max-tokens", str(opts.max_turns * opts.max_tokens_per_turn),
    ]  # fmt: skip


def step_simulate(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """Simulated editor sessions served by production on train tasks (only the ones not yet run)."""
    key = f"since@{cycle}"
    if key not in state.data:  # the cycle's sessions are the ones started after this point
        state.data[key] = {
            "seq": int(_db_scalar("SELECT coalesce(max(seq), 0) FROM event_log") or 0),
            "at": str(_db_scalar("SELECT now()")),
        }
        state.save()
    since = state.data[key]
    done = int(
        _db_scalar(
            "SELECT count(DISTINCT session_id) FROM event_log WHERE type = 'session.started' AND seq > :seq",
            seq=since["seq"],
        )
        or 0
    )
    done += int(
        _db_scalar(
            "SELECT count(*) FROM privacy_tombstone WHERE first_seen_at > CAST(:at AS timestamptz)", at=since["at"]
        )
        or 0
    )
    remaining = opts.sessions - done
    if remaining <= 0:
        return f"{done} sessions already simulated"
    if opts.engine == "vllm":
        wait_serving_production()
    flywheel(
        [
            "simulate",
            "--sessions",
            str(remaining),
            "--group-size",
            str(min(opts.group_size, remaining)),
            "--source",
            opts.source,
            *session_budget_args(opts),
            "--seed",
            str(opts.seed + 1000 * cycle + done),
        ],
        opts,
    )
    return f"{remaining} sessions simulated"


def step_finalize(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """Wait until the consumer has stored every session and every trajectory is finalized."""
    since = state.data.get(f"since@{cycle}", {}).get("at", "-infinity")  # a state from before cycles: all
    deadline = time.monotonic() + opts.finalize_timeout_s
    seen, steady_since = -1, time.monotonic()
    with Progress(transient=True) as progress:
        task = progress.add_task("finalizing trajectories", total=None)
        while True:
            total = int(_db_scalar("SELECT count(*) FROM trajectory") or 0)
            provisional = int(_db_scalar("SELECT count(*) FROM trajectory WHERE status <> 'finalized'") or 0)
            # this cycle's sessions stored so far: trajectories, or tombstones of privacy-mode sessions
            stored = int(
                _db_scalar(
                    "SELECT (SELECT count(*) FROM trajectory WHERE started_at > CAST(:at AS timestamptz)) + "
                    "(SELECT count(*) FROM privacy_tombstone WHERE first_seen_at > CAST(:at AS timestamptz))",
                    at=since,
                )
                or 0
            )
            if stored != seen:
                seen, steady_since = stored, time.monotonic()
            progress.update(task, total=max(total, 1), completed=total - provisional)
            # every session of the cycle is in (a session that failed before starting never arrives:
            # then the count has stopped moving for 10 s), and nothing is provisional
            arrived = stored >= opts.sessions or (stored and time.monotonic() - steady_since > 10)
            if arrived and not provisional:
                return f"{total} trajectories finalized ({stored} sessions of this cycle stored)"
            if time.monotonic() > deadline:
                raise FlywheelError(
                    f"{provisional} of {total} trajectories still provisional after "
                    f"{opts.finalize_timeout_s:.0f}s; is the consumer running? see logs/consumer.log"
                )
            # The consumer started in "services" sweeps closed windows every 2 s (see _env).
            time.sleep(2.0)


def step_train(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """One training cycle from production on the newly finalized trajectories."""
    if state.data.get(f"candidate@{cycle}"):
        return f"candidate {state.data[f'candidate@{cycle}']} exists"
    args = ["train", "--once", "--min-new", "1", "--json"]
    if opts.train_max_steps:
        args += ["--max-steps", str(opts.train_max_steps)]
    if opts.trainer_config:
        args += ["--config", opts.trainer_config]
    result = json.loads([ln for ln in flywheel(args, opts, capture=True).stdout.splitlines() if ln.startswith("{")][-1])
    candidate = result.get("checkpoint_id")
    if not candidate:
        raise FlywheelError(f"the training cycle produced no checkpoint: {result}")
    state.data[f"candidate@{cycle}"] = candidate
    state.save()
    return f"candidate {candidate} on {result.get('num_trajectories')} trajectories"


def step_gate(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """Evals of candidate and production on held-out tasks, then the gate decision."""
    candidate = state.data[f"candidate@{cycle}"]
    decided = _db_scalar(
        "SELECT passed FROM gate_decision WHERE candidate_id = :c ORDER BY created_at DESC LIMIT 1", c=candidate
    )
    if decided is not None:
        return f"gate already decided: {'passed' if decided else 'failed'}"
    # Every gated suite runs unless named (mined is empty until tasks are mined, which the gate allows).
    # Samples per task: the suites' own samples_per_task (sized for power, docs/gate.md) would
    # multiply the demo's eval time by k; the demo uses --eval-samples (1).
    # Named suites are run and decide the gate alone (--gate-on); by default every gated suite does.
    flywheel(
        [
            "gate",
            candidate,
            *(a for s in opts.eval_suites for a in ("--suite", s, "--gate-on", s)),
            "--limit",
            str(opts.eval_tasks),
            "--samples",
            str(opts.eval_samples),
            "--max-turns",
            str(opts.eval_max_turns),
            "--max-tokens",
            str(opts.eval_max_tokens),
            "--min-pairs",
            str(opts.eval_tasks),
        ],
        opts,
    )
    decided = _db_scalar(
        "SELECT coalesce(report->>'decision', CASE WHEN passed THEN 'pass' ELSE 'fail' END) FROM gate_decision "
        "WHERE candidate_id = :c ORDER BY created_at DESC LIMIT 1",
        c=candidate,
    )
    return f"gate decision: {decided}"


def step_release(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """As a release manager, through the promotion API: promote if the gate passed, else reject."""
    # Insufficient evidence is overridden only with the written reason --override-insufficient
    # gives (audited as gate.overridden): an override is a person's judgement, never the default.
    candidate = state.data[f"candidate@{cycle}"]
    if "rm_token" not in state.data:
        proc = flywheel(
            ["tokens", "create", "--role", "release_manager", "--name", f"demo-release-manager-{int(time.time())}"],
            opts,
            capture=True,
        )
        token = proc.stdout.strip().splitlines()[-1].strip()
        state.data["rm_token"] = token
        state.save()
    headers = {"Authorization": f"Bearer {state.data['rm_token']}"}
    base = f"http://127.0.0.1:{state.data['api_port']}/v1"
    with httpx.Client(base_url=base, headers=headers, timeout=30.0) as client:
        ckpt = client.get(f"/checkpoints/{candidate}").raise_for_status().json()
        status = ckpt.get("status")
        if status in ("production", "rejected", "retired"):
            return f"candidate already {status}"
        production = client.get("/production").raise_for_status().json()
        production_id = (production.get("checkpoint") or {}).get("id")
        if status == "gate_passed":
            resp = client.post(
                "/promotions",
                json={
                    "checkpoint_id": candidate,
                    "expected_production_id": production_id,
                    "reason": f"demo cycle {cycle}: gate passed on the held-out suites",
                },
            )
            verb = "promoted"
        elif (ckpt.get("latest_gate") or {}).get("decision") == "insufficient_evidence" and opts.override_insufficient:
            resp = client.post(
                "/promotions",
                json={
                    "checkpoint_id": candidate,
                    "expected_production_id": production_id,
                    "reason": f"demo cycle {cycle}: promoted over insufficient evidence",
                    "override_reason": opts.override_insufficient,
                },
            )
            verb = "promoted over insufficient evidence (audited override)"
        else:
            decision = (ckpt.get("latest_gate") or {}).get("decision", "fail")
            why = (
                "the gate found insufficient evidence (too few eval pairs for the power to pass); "
                "not promoted without evidence"
                if decision == "insufficient_evidence"
                else f"gate not passed (decision {decision}, status {status})"
            )
            resp = client.post(f"/checkpoints/{candidate}/reject", json={"reason": f"demo cycle {cycle}: {why}"})
            verb = (
                "rejected" if decision != "insufficient_evidence" else "not promoted (insufficient evidence), rejected"
            )
        if resp.status_code >= 400:
            raise FlywheelError(f"release failed: {resp.status_code} {resp.text}")
    # The relay publishes the outbox row; give it a moment so the lifecycle topic has it.
    flywheel(["relay", "--once"], opts, capture=True)
    return f"{verb} {candidate}"


def step_measure(opts: DemoOptions, state: DemoState, home: Path, cycle: int) -> str:
    """The checkpoint now serving against base on fresh production traffic: a point of the curve."""
    if opts.ab_tasks < 2:
        return "skipped (--ab-tasks 0)"
    production = _db_scalar("SELECT id FROM checkpoint WHERE status = 'production'")
    base = _db_scalar("SELECT id FROM checkpoint WHERE parent_id IS NULL ORDER BY created_at LIMIT 1") or production
    proc = flywheel(
        [
            "ab",
            base,
            production,
            "--tasks",
            str(opts.ab_tasks),
            "--samples",
            str(opts.ab_samples),
            *session_budget_args(opts),
            "--seed",
            str(opts.seed),
            "--label",
            f"cycle-{cycle}",
            "--json",
        ],  # fmt: skip
        opts,
        capture=True,
    )
    ab = json.loads([ln for ln in proc.stdout.splitlines() if ln.startswith("{")][-1])
    point = curve_point(cycle, ab)
    state.data[f"curve@{cycle}"] = point
    state.save()
    lo, hi = point["pass_rate_ci"] or (None, None)
    interval = f" [{lo:.0%}, {hi:.0%}]" if lo is not None else ""
    return f"{production}: fresh-traffic pass rate {point['pass_rate']:.0%}{interval} over {point['pairs']} sessions"


def curve_point(cycle: int, ab: dict) -> dict[str, Any]:
    """One curve entry from a ``flywheel ab --json`` result: the served checkpoint's fresh-traffic
    pass rate and product signals with their 95 % intervals, and the difference from base."""
    m = ab["metrics"]
    return {
        "cycle": cycle,
        "checkpoint_id": ab["final"],
        "pairs": ab["pairs"],
        "pass_rate": m["pass_rate"]["final"],
        "pass_rate_ci": m["pass_rate"]["final_ci"],
        "diff_vs_base": m["pass_rate"]["diff"],
        "diff_vs_base_ci": m["pass_rate"]["ci"],
        "signals": {k: {"value": m[k]["final"], "ci": m[k]["final_ci"]} for k in CURVE_SIGNALS if k in m},
    }


def curve_conclusion(curve: list[dict[str, Any]]) -> str:
    """What the curve lets a reader conclude, in words (and the bigger command when it is too small)."""
    if not curve:
        return "no checkpoint was measured on fresh traffic."
    last = curve[-1]
    ci = last.get("diff_vs_base_ci")
    if last["checkpoint_id"] == curve[0]["checkpoint_id"] and all(
        p["checkpoint_id"] == last["checkpoint_id"] for p in curve
    ):
        verdict = f"production stayed {last['checkpoint_id']}: no candidate earned promotion in this run."
    elif ci and ci[0] > 0:
        verdict = (
            f"{last['checkpoint_id']} beats base on fresh traffic (difference interval {ci[0]:+.0%} to {ci[1]:+.0%})."
        )
    elif ci and ci[1] < 0:
        verdict = f"{last['checkpoint_id']} is worse than base on fresh traffic ({ci[0]:+.0%} to {ci[1]:+.0%})."
    else:
        verdict = f"{last['checkpoint_id']} cannot be told apart from base on {last['pairs']} fresh sessions."
    return (
        verdict + " This run is too small to conclude whether the loop improves production: "
        "`python bench/flywheel.py` (4 cycles, 31-51 minutes on 2 CPU cores) is sized to show it "
        "(docs/benchmarks.md#flywheel)."
    )


def step_report(opts: DemoOptions, state: DemoState, home: Path) -> str:
    """Terminal report plus HTML and PNG under ``$FLYWHEEL_HOME/reports/demo``, with learning curves."""
    out = get_settings().store.reports() / "demo"
    last = state.data.get(f"candidate@{opts.cycles}")
    with session_scope() as session:
        _, html_path = write_report(session, out, last)
    curve = [state.data[f"curve@{c}"] for c in range(1, opts.cycles + 1) if f"curve@{c}" in state.data]
    report = json.loads((out / "report.json").read_text())
    report["curve"] = curve
    report["curve_conclusion"] = curve_conclusion(curve)
    (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    render_curve_terminal(curve, report["curve_conclusion"])
    if curve:
        render_curve_png(curve, out / "fresh_traffic.png")
        html_path.write_text(
            html_path.read_text().replace(
                "</body></html>",
                '<h2>The served checkpoint on fresh traffic</h2><img src="fresh_traffic.png">'
                f"<p>{report['curve_conclusion']}</p></body></html>",
            )
        )
    return f"report: {html_path}"


def render_curve_png(curve: list[dict[str, Any]], path: Path) -> Path:
    """The fresh-traffic curve: per cycle, the served checkpoint's hidden-test pass rate and product
    signals, each with its 95 % interval bar (task-clustered, ``ops.ab``)."""
    matplotlib.use("Agg")

    fig, axes = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [p["cycle"] for p in curve]
    labels = [f"{p['cycle']}\n{p['checkpoint_id'][-6:]}" for p in curve]

    def bars(ax, values, cis, label):
        # a signal undefined in a cycle (no edit to persist, fewer than two tasks) has no point
        pts = [(c, v, ci) for c, v, ci in zip(x, values, cis) if v is not None]
        if not pts:
            return
        xs, vs, intervals = zip(*pts)
        lo = [max(0.0, v - ci[0]) if ci else 0 for v, ci in zip(vs, intervals)]
        hi = [max(0.0, ci[1] - v) if ci else 0 for v, ci in zip(vs, intervals)]
        ax.errorbar(xs, vs, yerr=[lo, hi], marker="o", capsize=4, label=label)

    bars(axes[0], [p["pass_rate"] for p in curve], [p["pass_rate_ci"] for p in curve], "hidden-test pass rate")
    axes[0].set_title("served checkpoint on fresh traffic: pass rate (95 % CI)")
    for name in ("edit_persistence", "dissatisfied_followup_rate"):
        sig = [p["signals"].get(name, {}) for p in curve]
        bars(axes[1], [s.get("value") for s in sig], [s.get("ci") for s in sig], name)
    axes[1].set_title("product signals (95 % CI)")
    for ax in axes:
        ax.set_ylim(0, 1)
        ax.set_xticks(x, labels)
        ax.set_xlabel("cycle / serving checkpoint")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def render_curve_terminal(curve: list[dict[str, Any]], conclusion: str) -> None:
    """The fresh-traffic curve as an 80-column table, one row per cycle, then the conclusion."""

    def pct(v, ci=None) -> str:
        if v is None:
            return "-"
        return f"{v:.0%}" + (f" [{ci[0]:.0%},{ci[1]:.0%}]" if ci else "")

    table = Table(title="served checkpoint on fresh traffic (95 % intervals)", title_justify="left")
    for col in ("cycle", "serving", "pass rate", "persist", "follow-up", "tokens"):
        table.add_column(col, overflow="fold")
    for p in curve:
        sig = p["signals"]
        table.add_row(
            str(p["cycle"]),
            p["checkpoint_id"],
            pct(p["pass_rate"], p["pass_rate_ci"]),
            pct(sig.get("edit_persistence", {}).get("value")),
            pct(sig.get("dissatisfied_followup_rate", {}).get("value")),
            f"{sig.get('mean_completion_tokens', {}).get('value') or 0:.0f}",
        )
    con = Console(width=80)
    con.print(table)
    con.print(conclusion)


SETUP_FUNCS = {"stack": step_stack, "model": step_model, "serving": step_serving, "services": step_services}
CYCLE_FUNCS = {
    "simulate": step_simulate,
    "finalize": step_finalize,
    "train": step_train,
    "gate": step_gate,
    "release": step_release,
    "measure": step_measure,
}


def run_demo(opts: DemoOptions) -> None:
    """Run every step not yet done (see the module docstring).

    Raises:
        FlywheelError: a step failed; re-running continues from that step.
    """
    home = flywheel_home()
    state = DemoState(home)
    con = Console()
    started = time.monotonic()
    plan = [(step, None) for step in SETUP_STEPS]
    plan += [(step, c) for c in range(1, opts.cycles + 1) for step in CYCLE_STEPS]
    plan.append(("report", None))
    for i, (step, cycle) in enumerate(plan, 1):
        key = step if cycle is None else f"{step}@{cycle}"
        func = SETUP_FUNCS.get(step) or CYCLE_FUNCS.get(step) or step_report
        where = f"[{i}/{len(plan)}] {step}" + (f" (cycle {cycle}/{opts.cycles})" if cycle else "")
        # "stack", "serving", "services" and "report" always run: processes die with the machine,
        # reports are cheap.
        if state.done(key) and step not in ("services", "serving", "stack", "report"):
            con.print(f"[dim]{where}: done earlier[/]")
            continue
        t0 = time.monotonic()
        con.print(f"[bold cyan]{where}[/]: {func.__doc__.splitlines()[0]}")
        get_settings.cache_clear()
        summary = func(opts, state, home) if cycle is None else func(opts, state, home, cycle)
        state.mark(key)
        con.print(f"    {summary} [dim]({time.monotonic() - t0:.0f}s)[/]")
    con.print(
        f"[bold green]demo finished in {time.monotonic() - started:.0f}s[/]; "
        f"`flywheel demo --down` stops what it started"
    )


def stop_demo() -> list[str]:
    """Stop every process the demo (and the stack) started."""
    return stack_down()

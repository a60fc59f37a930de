"""The deploy runs and ships: ``ops/deploy/compose.yaml`` started on Docker (with ``compose.local.yaml`` on
a host without GPUs, an image registry or a bridge) and driven as a product backend drives it.

1. Build the images (``ops/deploy/standins.sh``: stand-ins from Debian's packages where upstream
   images cannot be pulled, flywheel's own image from ``ops/deploy/Dockerfile``) and start the
   deploy: Postgres, Redis, the broker, the production, eval and canary vLLM servers and every
   flywheel process. ``compose_up_s``: until the API, the front and the three servers answer.
2. Create the product backend's key (an ``inference`` token, ``flywheel tokens create``) and check
   that the front answers a request without it with 401 (``front_without_key_status``).
3. Send simulated sessions through the front with the key (``flywheel simulate`` in a one-off
   container: the producer SDK to Kafka, completions through the front). Beat starts a training
   cycle once the traffic is finalized, the worker gates the candidate on the SHIPPED policy
   (``evals/gate.toml``: every default-gated suite, sandboxed tests in the grading containers under
   the shipped seccomp profile), ``auto_on_pass`` promotes it if the gate passed, and the watcher
   reloads the production server. ``first_promotion_s``: from the end of step 1 until the production
   server reports the promoted checkpoint; ``sandboxed_evals`` and ``sandbox_errors`` count the
   gate's graded results and those the sandbox failed.
4. Faults, one at a time, each a SIGKILL of the container's main process from the host (Docker
   restarts it by its policy): the worker mid training cycle, the consumer mid batch (traffic
   flowing), the production vLLM server, Postgres. After each: the container restarted, no event
   lost or stored twice (every event the SDK sent is in ``event_log`` once, none dead-lettered), and
   the production server serves what the database says.

The schedule is compressed as the demo compresses ``flywheel up``'s (signal window, readiness); the
trainer takes a small step (``--lr``, ``--steps``) so the candidate stays near production, since this
bench measures the deploy, not learning (``bench/flywheel.py`` does). ``--quick``: one cycle's traffic
of 16 sessions and the four faults. ``--gate-on SUITES``: the gate runs only those suites
(``FLYWHEEL_EVAL_GATE_ON``), for a CPU host where the shipped gate takes hours per checkpoint
(docs/benchmarks.md, "deploy"); the JSON's ``gate_policy`` says so, ``checks_passed`` covers the
checks above and ``pass`` needs the shipped policy besides. Without Docker and Compose v2 it says so
in one line and exits 1.
Prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

from bench.deploy_stack import ADDRESS, DEPLOY, Deploy, compose_v2, wait_for
from serving.vllm_command import resolve_dtype

PROJECT = "flywheel-bench"


def settings(sessions: int, gate_on: list[str] | None = None) -> dict[str, str]:
    """The loop's settings on the bench's schedule (``ops.demo.loop_env``'s compression); ``gate_on``
    narrows the gate to those suites (``FLYWHEEL_EVAL_GATE_ON``), None keeps the shipped policy's."""
    narrowed = {"FLYWHEEL_EVAL_GATE_ON": json.dumps(gate_on)} if gate_on else {}
    return narrowed | {
        "FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S": "20",
        "FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S": "2",
        "FLYWHEEL_CONSUMER_FINALIZE_GRACE_S": "1",
        "FLYWHEEL_TRAIN_READY_TRAJECTORIES": str(sessions),
        "FLYWHEEL_TRAIN_READY_QUIET_S": "20",
        "FLYWHEEL_TRAIN_CHECK_INTERVAL": "5",
        "FLYWHEEL_TRAIN_INTERVAL": str(30 * 24 * 3600),  # cycles start when their traffic is in
        "FLYWHEEL_EVAL_SCAN_INTERVAL": "20",
        "FLYWHEEL_EVAL_MINE_INTERVAL": "0",  # simulated traffic replays training tasks: nothing to mine
        "FLYWHEEL_RELEASE_POLICY": "auto_on_pass",
        "_dtype": resolve_dtype("auto", cuda=False),
    }


def trainer_toml(lr: float, steps: int, sessions: int) -> str:
    return (
        'extends = "/srv/flywheel/trainer/configs/default.toml"\n'
        f"max_steps = {steps}\n\n[data]\nmin_new_trajectories = {min(sessions, 8)}\n\n[optim]\nlr = {lr}\n"
    )


def simulate(deploy: Deploy, key: str, sessions: int, seed: int) -> dict:
    """``flywheel simulate`` through the front, as the product backend; its summary line. It runs in a
    one-off of the worker's service: the simulated developer grades each session in the sandbox, which
    only the graders' containers can build."""
    out = deploy.flywheel(
        "simulate", "--sessions", str(sessions), "--group-size", "4", "--source", "functions",
        "--privacy-rate", "0", "--max-turns", "2", "--max-tokens", "256", "--concurrency", "16",
        "--seed", str(seed), "--json",
        env={"FLYWHEEL_FRONT_URL": "http://front:8100", "FLYWHEEL_FRONT_API_KEY": key}, service="worker",
    )  # fmt: skip
    return json.loads(out.strip().splitlines()[-1])


def stored_events(deploy: Deploy) -> tuple[int, int, int]:
    """``(rows, distinct event ids, dead letters)`` in the deploy's store."""
    rows, distinct = deploy.query("SELECT count(*), count(DISTINCT event_id) FROM event_log")[0]
    dead = deploy.query("SELECT count(*) FROM dead_letter")[0][0]
    return int(rows), int(distinct), int(dead)


class Ledger:
    """Events the product backend sent, against what the store holds."""

    def __init__(self) -> None:
        self.sent = 0

    def add(self, summary: dict) -> None:
        self.sent += int(summary["producer"]["sent"])

    def settled(self, deploy: Deploy, timeout_s: float = 300) -> dict:
        """Wait until the consumer has stored every sent event (or ``timeout_s``); the counts."""
        try:
            wait_for(lambda: stored_events(deploy)[1] >= self.sent, timeout_s, "every sent event in event_log")
        except TimeoutError:
            pass
        rows, distinct, dead = stored_events(deploy)
        return {"sent": self.sent, "lost": max(0, self.sent - distinct), "duplicated": rows - distinct, "dead": dead}


def promoted_and_served(deploy: Deploy, after: set[str]) -> str | None:
    """A checkpoint promoted since ``after`` (ids seen before) that the production server serves."""
    prod = deploy.production()
    return prod if prod not in after and deploy.served() == prod else None


def gate_read_out(deploy: Deploy, candidate: str) -> dict:
    """The candidate's gate decision and its graded results (those the sandbox failed apart)."""
    decision = deploy.query("SELECT decision, status FROM checkpoint WHERE id = %s", candidate)
    graded, sandbox_errors = deploy.query(
        "SELECT count(*), count(*) FILTER (WHERE r.error ILIKE ANY (ARRAY['%%sandbox%%', '%%bwrap%%', "
        "'%%bubblewrap%%', '%%namespace%%'])) FROM eval_result r JOIN eval_run u ON u.id = r.run_id"
    )[0]
    return {"gate_decision": decision[0][0] if decision else None, "status": decision[0][1] if decision else None,
            "sandboxed_evals": int(graded), "sandbox_errors": int(sandbox_errors)}  # fmt: skip


def fault(deploy: Deploy, service: str, ledger: Ledger, key: str, seed: int, wait_s: float) -> dict:
    """Crash ``service`` at its busiest moment, then check it came back and nothing was lost."""
    t0 = time.monotonic()
    traffic: list[dict] = []
    runner = None
    if service == "worker":  # mid training cycle: traffic for a cycle, then wait until it trains
        ledger.add(simulate(deploy, key, 16, seed))
        wait_for(lambda: deploy.query("SELECT 1 FROM training_cycle WHERE status = 'running'"), wait_s, "a cycle")
    elif service == "consumer":  # mid batch: while the product backend sends
        runner = threading.Thread(target=lambda: traffic.append(simulate(deploy, key, 16, seed)))
        runner.start()
        start = stored_events(deploy)[0]
        wait_for(lambda: stored_events(deploy)[0] > start, wait_s, "the consumer storing events", interval_s=0.5)
    cycles = deploy.query("SELECT count(*) FROM checkpoint")[0][0]
    before = deploy.crash(service)
    recovered = True
    try:
        wait_for(lambda: deploy.restarted(service, before), 300, f"{service} restarted")
        if service == "worker":  # the loop goes on: a cycle completes after the restart
            wait_for(lambda: deploy.query("SELECT count(*) FROM checkpoint")[0][0] > cycles, wait_s, "a new cycle")
        if service in ("vllm", "postgres"):
            wait_for(lambda: deploy.healthy("api", "/healthz", 8000), 300, "the API")
        wait_for(deploy.served_matches_db, wait_s, "production served as the database says")
    except TimeoutError as exc:
        recovered = False
        print(f"{service}: {exc}\n{deploy.logs(service)}", file=sys.stderr)
    if runner is not None:
        runner.join()
        ledger.add(traffic[0])
    if service == "postgres":  # after the restart the product backend's events still land
        ledger.add(simulate(deploy, key, 8, seed + 1))
    counts = ledger.settled(deploy)
    return {"container": service, "recovered": recovered, "lost_events": counts["lost"],
            "duplicated_events": counts["duplicated"], "seconds": round(time.monotonic() - t0, 1)}  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="16 sessions before the first promotion (default 32)")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--lr", type=float, default=1e-6, help="the trainer's learning rate (a small step)")
    ap.add_argument("--steps", type=int, default=2, help="optimizer steps a cycle")
    ap.add_argument("--wait-s", type=float, default=10800, help="longest wait for a cycle, gate and promotion (s)")
    ap.add_argument("--rebuild", action="store_true", help="rebuild flywheel's image first (after a change)")
    ap.add_argument("--keep", action="store_true", help="leave the deploy running (docker compose -p flywheel-bench)")
    ap.add_argument(
        "--gate-on", default=None,
        help="comma-separated suites the gate runs instead of the shipped policy's (a smaller gate that fits a "
        "CPU host; the JSON says so and `pass` needs the shipped policy)",
    )  # fmt: skip
    args = ap.parse_args()
    compose = compose_v2()
    if compose is None:
        print(
            json.dumps(
                {"bench": "deploy", "pass": False, "error": "needs Docker and Compose v2 (ops/deploy/docker-host.sh)"}
            )
        )
        sys.exit(1)
    sessions = args.sessions or (16 if args.quick else 32)
    t0 = time.monotonic()
    build = subprocess.run(["bash", str(DEPLOY / "standins.sh"), *(["--rebuild"] if args.rebuild else [])])
    if build.returncode != 0:
        sys.exit("image build failed")
    build_s = time.monotonic() - t0
    workdir = Path(tempfile.mkdtemp(prefix="flywheel-bench-deploy-"))
    gate_on = [s.strip() for s in args.gate_on.split(",") if s.strip()] if args.gate_on else None
    deploy = Deploy.create(
        PROJECT, workdir, compose, settings(sessions, gate_on), trainer_toml(args.lr, args.steps, sessions)
    )
    result: dict = {"bench": "deploy", "sessions": sessions, "lr": args.lr, "steps": args.steps,
                    "gate_policy": {"shipped": gate_on is None, "gate_on": gate_on or "the policy's suites"}}  # fmt: skip
    try:
        t_up = time.monotonic()
        deploy.run("up", "-d", timeout_s=1800)
        for service, path, port in (("api", "/healthz", 8000), ("front", "/healthz", 8100), ("vllm", "/health", 8000),
                                    ("vllm-eval", "/health", 8000), ("vllm-canary", "/health", 8000)):  # fmt: skip
            wait_for(lambda s=service, p=path, q=port: deploy.healthy(s, p, q), 900, f"{service} to answer")
        up_done = time.monotonic()
        result["compose_up_s"] = round(up_done - t_up, 1)
        key = json.loads(
            deploy.flywheel("tokens", "create", "--role", "inference", "--name", "product-backend", "--json")
        )["token"]
        no_key = httpx.post(
            f"http://{ADDRESS['front']}:8100/v1/completions",
            json={"model": "flywheel", "prompt": "x", "user": "u"},
            timeout=30,
        )
        result["front_without_key_status"] = no_key.status_code
        ledger, base = Ledger(), deploy.production()
        ledger.add(simulate(deploy, key, sessions, seed=1))
        served = wait_for(lambda: promoted_and_served(deploy, {base}), args.wait_s, "a promotion served", 10)
        result["first_promotion_s"] = round(time.monotonic() - up_done, 1)
        result.update(gate_read_out(deploy, served), promoted=served, served_matches_db=deploy.served_matches_db())
        result["faults"] = [
            fault(deploy, name, ledger, key, seed=10 + i, wait_s=args.wait_s)
            for i, name in enumerate(("worker", "consumer", "vllm", "postgres"))
        ]
        result["events"] = ledger.settled(deploy)
        result["served_matches_db"] = result["served_matches_db"] and deploy.served_matches_db()
    except (TimeoutError, RuntimeError) as exc:
        result["error"] = str(exc)
        for service in ("worker", "eval-worker", "watcher", "consumer"):
            print(f"--- {service}\n{deploy.logs(service)}", file=sys.stderr)
    finally:
        if args.keep:
            print(f"kept: {deploy.command_line()} down -v", file=sys.stderr)
        else:
            deploy.run("down", "-v", "--remove-orphans", check=False, timeout_s=600)
    faults = result.get("faults", [])
    result["build_s"] = round(build_s, 1)
    result["wall_s"] = round(time.monotonic() - t0, 1)
    result["checks_passed"] = bool(
        "error" not in result and result.get("front_without_key_status") == 401 and result.get("promoted")
        and result.get("sandboxed_evals", 0) > 0 and result.get("sandbox_errors", 1) == 0
        and result.get("served_matches_db") and len(faults) == 4
        and all(f["recovered"] and f["lost_events"] == 0 and f["duplicated_events"] == 0 for f in faults)
    )  # fmt: skip
    result["pass"] = result["checks_passed"] and gate_on is None  # the target is the shipped policy's gate
    print(json.dumps(result))


if __name__ == "__main__":
    main()

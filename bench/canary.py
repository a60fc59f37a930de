"""Canary of a planted bad candidate versus a copy of production, on simulated live traffic: does
the online promotion policy block the bad one and let the equal one through?

Set-up (all real): a tansu broker and a scratch Postgres database (the server of
``FLYWHEEL_DATABASE_URL`` if set, else 127.0.0.1:5432, else an embedded one), migrated; the real
SmolLM2-135M-Instruct registered as production ``base``; two candidates registered beside it:

- ``bad``: base with Gaussian noise added to every weight matrix (``--noise`` times each tensor's
  own standard deviation, seeded), a planted regression;
- ``same``: an exact copy of base (hardlinked files), which must not be blocked.

Each candidate gets a passed gate decision whose stored config carries the shipped gate policy
with ``[online] required = true``, ``--min-sessions`` per arm and ``--signals``; the offline evals
themselves are ``bench/eval.py``'s subject, not this one's. ``--signals`` leaves out
``latency_per_token`` by default: here both arms are served by one process on the same two cores,
each arm's engine running beside the other arm's, so an arm's seconds per token follow the other
arm's concurrent work and the machine's load, not only its checkpoint (``docs/benchmarks.md`` has what it measured for an identical copy). The
signal is still printed; with separate servers, as in production, it measures the checkpoint and
belongs in the policy (the shipped ``evals/gate.toml`` keeps it).

Then, for each candidate in turn: ``start_canary`` (``--fraction`` of users, sticky by user hash)
-> ``run_simulation`` with ``EngineRouter.engine_for`` choosing the production engine or the
canary engine (a second in-process reference engine built by ``serving.engine.setup_engine`` in the canary role from the candidate's folder)
per user, every event through the producer SDK to the broker -> the ingest consumer (Kafka ->
event_log -> trajectories) -> the window sweep finalizes and labels -> ``promote_checkpoint``
decides in a transaction that is rolled back (production stays ``base`` for the next candidate)
-> ``stop_canary``.

Printed: per candidate, every online signal of both arms with canary - production and its 95 %
interval clustered by user (Deng et al. 2018 delta method), and the policy's reasons. Beside ours,
the same policy with a naive per-session (i.i.d.) interval, for comparison.

JSON line: ``ours`` = correct decisions of the policy (bad blocked, equal allowed; 0-2),
``baseline`` = 2 (the limit), ``ratio`` = ours / 2, ``target`` = 1, ``pass`` = both right.

Flags: ``--quick`` (fewer, shorter sessions), ``--sessions N`` (simulated sessions per canary),
``--source`` (the simulator's task source, training split; ``functions``, the in-reach requests, where
the model edits in most sessions so acceptance and persistence have data on both arms), ``--fraction F``
(share of users in the canary arm; 0.5), ``--noise X`` (the bad candidate's noise in units of each
tensor's std; 0.5), ``--min-sessions N`` (the policy's fewest sessions per arm), ``--signals ...``,
``--max-tokens-per-turn N``, ``--threads N``, ``--seed N``. Measured results and time budgets:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import time
import uuid
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import torch
from ingest import scratch_database, scratch_server  # noqa: E402  (bench/ingest.py helpers)
from safetensors.torch import load_file, save_file

import app.repositories.binary  # noqa: E402,F401  its psycopg dumpers must exist before the first connection
from app.checkpoints.publish import converted_base_dir, init_base, register_model
from app.core.db import get_sessionmaker, session_scope
from app.core.errors import ConflictError
from app.core.pids import stop_pid
from app.core.settings import get_settings
from app.lifecycle.canary import start_canary, stop_canary
from app.lifecycle.changes import promote_checkpoint
from app.lifecycle.online import canary_arms, online_view
from app.lifecycle.online_stats import OnlinePolicy, compare_arms, policy_reasons
from app.lifecycle.production import latest_gate_decision
from app.models import Checkpoint, GateDecision
from app.models.checkpoints import CheckpointStatus, GateVerdict
from consumers.finalize import finalize_due
from consumers.ingest import IngestConsumer, projector_from_settings
from consumers.settings import get_consumer_settings
from evals.gate.policy import load_gate_config
from ops.broker import create_topics, start_broker
from ops.simulator import SimulatorConfig, run_simulation
from producers.producer import EventProducer
from serving.canary import ActiveCanary, EngineRouter
from serving.engine import setup_engine
from serving.reference_engine import ReferenceEngine

SIGNAL_ORDER = ("edit_acceptance", "edit_persistence", "dissatisfied_followup_rate", "latency_per_token", "mean_reward")


def write_noisy_copy(src: Path, dst: Path, noise: float, seed: int) -> Path:
    """A HF folder equal to ``src`` but with ``w + noise * std(w) * N(0, 1)`` for every floating
    tensor of 2 or more dimensions (embeddings, attention and MLP matrices; norms kept)."""
    dst.mkdir(parents=True)
    for f in src.iterdir():
        if f.is_file() and f.name != "model.safetensors":
            shutil.copy2(f, dst / f.name)
    state = load_file(src / "model.safetensors")
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.is_floating_point() and t.dim() >= 2:
            state[name] = t + noise * t.float().std() * torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(state, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


def seed_passed_gate(checkpoint_id: str, production_id: str, min_sessions: int, signals: list[str]) -> None:
    """A passed gate decision whose stored config is the shipped policy with the online
    requirement on (what ``flywheel gate`` would store with ``[online] required = true``)."""
    config = load_gate_config()
    config = config.model_copy(
        update={
            "online": config.online.model_copy(
                update={"required": True, "min_sessions": min_sessions, "signals": signals}
            )
        }
    )
    with session_scope() as session:
        session.add(
            GateDecision(
                id=uuid.uuid4(),
                candidate_id=checkpoint_id,
                production_id=production_id,
                passed=True,
                decision=GateVerdict.PASS.value,
                reasons=[],
                report={"config": config.model_dump(mode="json"), "note": "bench/canary.py: offline gate not run here"},
            )
        )
        row = session.get(Checkpoint, checkpoint_id)
        # a seeded gate, as the gate would leave it (bench/canary measures the online policy, not the gate)
        row.status, row.decision = CheckpointStatus.GATE_PASSED.value, GateVerdict.PASS.value


def naive_reasons(canary, policy) -> list[str]:
    """The policy's reasons with a per-session (unclustered) interval: each session its own user."""
    with session_scope() as session:
        c, p = canary_arms(session, canary)
    solo = lambda rows: [replace(s, user_id=f"session-{i}") for i, (_, s) in enumerate(rows)]  # noqa: E731
    return policy_reasons(compare_arms(solo(c), solo(p), policy.signals, policy.confidence), policy)


def run_canary(checkpoint_id: str, prod_engine, config, args) -> dict:
    """One canary of ``checkpoint_id``: traffic, ingest, finalize, the policy's decision, stop."""
    with session_scope() as session:
        canary = start_canary(
            session,
            checkpoint_id=checkpoint_id,
            fraction=args.fraction,
            actor="bench",
            reason="bench: online signals of a candidate",
        )
        active = ActiveCanary(
            canary_id=str(canary.id),
            checkpoint_id=checkpoint_id,
            fraction=canary.fraction,
            path=session.get(Checkpoint, checkpoint_id).path,
        )
    router = EngineRouter(prod_engine)
    router.start(active, setup_engine(checkpoint_id=checkpoint_id, model_dir=Path(active.path), role="canary"))
    t = time.monotonic()
    with EventProducer() as producer:
        summaries = run_simulation(
            config,
            prod_engine,
            producer.emit,
            engine_for=router.engine_for,
            progress=lambda s: print(
                f"  session {s['session']:3d} {s.get('checkpoint_id', '?'):>5s}"
                f" edited={s.get('edited')} {s.get('wall_s')} s",
                file=sys.stderr,
                flush=True,
            ),
        )
        producer.flush(timeout_s=60)
    simulate_s = time.monotonic() - t
    router.stop()
    t = time.monotonic()
    IngestConsumer(client_id=f"bench-canary-{checkpoint_id}").run(idle_exit_s=4)
    time.sleep(get_consumer_settings().signal_window_s)
    finalize_due(projector_from_settings(), grace_s=0)
    ingest_s = time.monotonic() - t

    session = get_sessionmaker()()
    try:  # the real promotion path decides; rolled back so production stays base for the next canary
        promote_checkpoint(
            session,
            checkpoint_id=checkpoint_id,
            expected_production_id="base",
            actor="bench",
            reason="bench: would the policy allow it",
        )
        allowed, reasons = True, []
    except ConflictError as exc:
        allowed, reasons = False, exc.reasons
    finally:
        session.rollback()
        session.close()
    with session_scope() as session:
        row = session.get(Checkpoint, checkpoint_id)
        gate = latest_gate_decision(session, checkpoint_id)
        policy = OnlinePolicy.from_config(gate.report["config"])
        view = online_view(session, row, policy=policy)["canary"]
        canary = stop_canary(session, actor="bench", reason="bench: canary measured")
        session.flush()
        session.expunge(canary)
    naive = naive_reasons(canary, policy)
    edited = {}
    for s in summaries:
        arm = edited.setdefault(s.get("checkpoint_id", "?"), [0, 0])
        arm[0] += 1
        arm[1] += bool(s.get("edited"))
    return {
        "allowed": allowed,
        "reasons": reasons,
        "naive_allowed": not naive,
        "naive_reasons": naive,
        "view": view,
        "sessions_edited": edited,
        "errors": sum(1 for s in summaries if "error" in s),
        "simulate_s": round(simulate_s, 1),
        "ingest_finalize_s": round(ingest_s, 1),
    }


def print_view(name: str, out: dict) -> None:
    view = out["view"]
    print(
        f"\n== canary of {name}: {view['canary_sessions']} canary vs {view['production_sessions']} production "
        f"sessions (sessions, edited per checkpoint: {out['sessions_edited']}; simulate {out['simulate_s']} s, "
        f"ingest+finalize {out['ingest_finalize_s']} s)"
    )
    print(f"{'signal':28s} {'canary':>10s} {'production':>10s} {'diff':>10s}  95% CI (clustered by user)")
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    for name_ in SIGNAL_ORDER:
        d = view["signals"][name_]
        ci = "-" if d["low"] is None else f"[{d['low']:+.4g}, {d['high']:+.4g}]"
        print(
            f"{name_:28s} {fmt(d['canary']):>10s} {fmt(d['production']):>10s} {fmt(d['diff']):>10s}  {ci}"
            f"{'  REGRESSED' if d['regressed'] else ''}"
        )
    verdict = "allows" if out["allowed"] else "refuses"
    print(f"policy {verdict} promotion" + "".join(f"\n  - {r}" for r in out["reasons"]))
    print(
        f"naive i.i.d. interval would {'allow' if out['naive_allowed'] else 'refuse'}"
        + "".join(f"\n  - {r}" for r in out["naive_reasons"])
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer, shorter sessions (<= 10 min on 2 busy cores)")
    ap.add_argument("--sessions", type=int, default=None, help="simulated sessions per canary")
    ap.add_argument(
        "--source", default="functions", help="simulator task source (training split; in reach, so sessions edit)"
    )
    ap.add_argument("--fraction", type=float, default=0.5, help="share of users in the canary arm")
    ap.add_argument(
        "--noise", type=float, default=0.5, help="noise of the bad candidate, in units of each tensor's std"
    )
    ap.add_argument("--min-sessions", type=int, default=None, help="the online policy's fewest sessions per arm")
    ap.add_argument(
        "--signals",
        nargs="+",
        choices=SIGNAL_ORDER,
        default=[s for s in SIGNAL_ORDER if s != "latency_per_token"],
        help="signals the policy requires (default: all but latency_per_token, see the docstring)",
    )
    ap.add_argument("--max-tokens-per-turn", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    sessions = args.sessions or (64 if args.quick else 160)
    args.min_sessions = args.min_sessions or (8 if args.quick else 30)
    max_tokens = args.max_tokens_per_turn or (128 if args.quick else 192)
    started = time.monotonic()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a timeout still stops the broker, drops the database

    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-canary-"))
    os.environ.update(
        FLYWHEEL_HOME=str(tmp),
        FLYWHEEL_CONSUMER_SIGNAL_WINDOW_S="2",
        FLYWHEEL_CONSUMER_FINALIZE_GRACE_S="0",
        FLYWHEEL_CONSUMER_FINALIZE_INTERVAL_S="1",
    )
    os.environ.setdefault("FLYWHEEL_TELEMETRY_EXPORTER", "none")
    os.environ["FLYWHEEL_SERVING_ENGINE"] = "reference"

    torch.set_num_threads(args.threads)

    broker = start_broker(tmp / "logs")
    admin, stop_server = scratch_server(tmp)
    drop = None
    try:
        topics = {
            "interactions": "bench.canary.interactions",
            "dlq": "bench.canary.dlq",
            "lifecycle": "bench.canary.lifecycle",
        }
        create_topics(broker.bootstrap, {topics["interactions"]: 4, topics["dlq"]: 1, topics["lifecycle"]: 1})
        url, drop = scratch_database(admin)
        os.environ.update(
            FLYWHEEL_DATABASE_URL=url,
            FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
            FLYWHEEL_KAFKA_INTERACTIONS_TOPIC=topics["interactions"],
            FLYWHEEL_KAFKA_DLQ_TOPIC=topics["dlq"],
            FLYWHEEL_KAFKA_LIFECYCLE_TOPIC=topics["lifecycle"],
            FLYWHEEL_KAFKA_CONSUMER_GROUP=f"bench-canary-{uuid.uuid4().hex[:6]}",
        )

        get_settings.cache_clear()
        get_consumer_settings.cache_clear()

        base_path = init_base()
        register_model(base_path, "same", CheckpointStatus.CANDIDATE, source="copy of base")
        register_model(
            write_noisy_copy(converted_base_dir(), tmp / "noisy", args.noise, args.seed),
            "bad",
            CheckpointStatus.CANDIDATE,
            source=f"base + {args.noise} std Gaussian noise",
        )
        shutil.rmtree(tmp / "noisy")
        for cid in ("bad", "same"):
            seed_passed_gate(cid, "base", args.min_sessions, args.signals)
        prod_engine = ReferenceEngine(base_path, checkpoint_id="base")
        config = SimulatorConfig(
            sessions=sessions,
            group_size=12,
            max_turns=1,
            max_tokens=max_tokens,
            max_tokens_per_turn=max_tokens,
            source=args.source,
            privacy_rate=0.0,
            persistence_delay_s=0.5,
            followup_delay_s=0.2,
            users=4 * sessions,
            seed=args.seed,
        )
        results = {cid: run_canary(cid, prod_engine, config, args) for cid in ("bad", "same")}
    finally:
        stop_pid(broker.pid)
        if drop is not None:
            drop()
        stop_server()
        shutil.rmtree(tmp, ignore_errors=True)
    for cid, out in results.items():
        print_view(cid, out)
    bad_blocked, equal_allowed = not results["bad"]["allowed"], results["same"]["allowed"]
    naive_correct = int(not results["bad"]["naive_allowed"]) + int(results["same"]["naive_allowed"])
    ours = int(bad_blocked) + int(equal_allowed)
    diffs = {
        cid: {
            s: [
                round(v, 5) if v is not None else None
                for v in (
                    out["view"]["signals"][s]["diff"],
                    out["view"]["signals"][s]["low"],
                    out["view"]["signals"][s]["high"],
                )
            ]
            for s in SIGNAL_ORDER
        }
        for cid, out in results.items()
    }
    print(
        json.dumps(
            {
                "bench": "canary",
                "ours": ours,
                "baseline": 2,
                "unit": "correct policy decisions (bad blocked, equal allowed)",
                "ratio": ours / 2,
                "target": 1.0,
                "pass": bad_blocked and equal_allowed,
                "bad_blocked": bad_blocked,
                "equal_allowed": equal_allowed,
                "naive_iid_correct": naive_correct,
                "bad_reasons": results["bad"]["reasons"],
                "equal_reasons": results["same"]["reasons"],
                "sessions": {
                    cid: [out["view"]["canary_sessions"], out["view"]["production_sessions"]]
                    for cid, out in results.items()
                },
                "diffs_with_95ci": diffs,
                "source": args.source,
                "noise": args.noise,
                "fraction": args.fraction,
                "min_sessions": args.min_sessions,
                "policy_signals": args.signals,
                "max_tokens_per_turn": max_tokens,
                "wall_s": round(time.monotonic() - started, 1),
            }
        )
    )


if __name__ == "__main__":
    main()

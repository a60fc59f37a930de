"""MoE router replay: serving/trainer mismatch with and without the recorded routes, one run.

A small Mixtral-style MoE (8 experts, top-2, several layers; random weights from a config,
``trainer.testing.build_tiny_moe``) serves agent sessions through the reference engine in its serving
precision (bf16-rounded weights). Each session is two turns (the second prompt appends a tool
observation to the first turn's context) and its events go the production way: the producer SDK
(``producers.EventProducer``) -> a real broker (tansu) -> the consumer group's ingest
(``consumers.ingest.IngestConsumer``) -> Postgres (``trajectory_segment.routed_experts``). The
trainer's data path (``trainer.selection.select_cycle_data``, ``trainer.batching.pack_micro_batches``)
loads them, and the trainer's fp32 model (the checkpoint's unrounded weights) scores every sampled
token with ``trainer.step.compute_old_logprobs`` twice: ``router_replay = false`` (the *baseline*:
the trainer routes every token itself) and ``router_replay = true`` (*ours*: R3, the serving routes
forced, gate weights from the trainer's router).

Measured: the mismatch ``KL(behaviour || trainer)`` per sampled token (the k3 estimate the trainer
reports, nats), the fraction of sampled tokens routed to another expert set in at least one layer
and of (token, layer) routing decisions that differ, each with and without replay, and the route
bytes stored per completion token (next to ``layers x top_k``, one byte an entry). Ends with one
JSON line; ``ratio`` = KL with replay / KL without, target <= 0.2 (``pass``).

What remains with replay is the dense part of the mismatch: attention, norms, embeddings and the
experts' own matmuls in bf16-rounded vs fp32 weights, which replay does not touch (with replay no
token's experts differ).

The random MoE's init std defaults to ``hidden ** -0.5`` (LeCun fan-in, variance preserving): each
expert MLP then returns about 0.6x the norm of its input, so every layer moves the residual stream
without the network exploding. A larger std makes the random network chaotic (0.2: 8.7x per layer,
the dense bf16 error grows with depth) and a smaller one quiets the MoE layers (0.05: 0.1x, 0.02:
0.006x), so route flips move the logits less; the ratio depends on it (``docs/benchmarks.md`` has
the sweep).

Flags: ``--quick`` (24 sessions of 2 x 32 tokens, 4 MoE layers), ``--sessions N``, ``--max-tokens N``
(completion tokens per turn), ``--layers N``, ``--hidden N`` (128), ``--init-std X`` (std of the
random MoE's init; ``hidden ** -0.5``), ``--threads N``. Measured results:
``docs/benchmarks.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # this checkout's packages, not an installed copy

import numpy as np
import torch
from ingest import scratch_database, scratch_server
from transformers import AutoModelForCausalLM

from app.core.db import reset_engines, session_scope
from app.core.pids import stop_pid
from app.core.settings import get_settings
from app.inference.engine import SamplingParams
from app.models import Checkpoint
from app.models.checkpoints import CheckpointStatus
from app.repositories.checkpoints import add_checkpoint
from consumers.ingest import IngestConsumer
from consumers.settings import get_consumer_settings
from ops.broker import create_topics, start_broker
from producers.events.types import (
    ModelResponded,
    ModelRespondedEvent,
    SessionEnded,
    SessionEndedEvent,
    SessionStarted,
    SessionStartedEvent,
)
from producers.producer import EventProducer
from serving.reference_engine import ReferenceEngine
from trainer.batching import pack_micro_batches
from trainer.config import TrainerConfig
from trainer.selection import select_cycle_data
from trainer.step import compute_old_logprobs
from trainer.testing import build_tiny_moe

TARGET = 0.2


def _scratch(tmp: Path):
    """(database url, cleanup) on the local Postgres (or an embedded one), migrated to head."""
    admin, stop_server = scratch_server(tmp)
    url, drop = scratch_database(admin)

    def cleanup() -> None:
        drop()
        stop_server()

    return url, cleanup


def generate_sessions(engine, n_sessions: int, max_tokens: int, seed: int):
    """Two-turn sessions served by ``engine`` as ``model.responded`` events (routes included)."""
    rng = np.random.default_rng(seed)
    envs = [dict(session_id=f"moe-{uuid.uuid4().hex[:10]}", user_id=f"u{i % 7}") for i in range(n_sessions)]
    events = [
        SessionStartedEvent(**e, payload=SessionStarted(task_id=f"task-{i}", checkpoint_id="moe-base"))
        for i, e in enumerate(envs)
    ]
    contexts = [[] for _ in envs]
    pending = [[1] + rng.integers(300, 40_000, size=int(rng.integers(12, 40))).tolist() for _ in envs]
    for turn in range(2):
        params = SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed + turn)
        gens = engine.generate([c + p for c, p in zip(contexts, pending)], params)
        for i, (env, g) in enumerate(zip(envs, gens)):
            layers, k = len(g.routed_experts[0]), len(g.routed_experts[0][0])
            events.append(
                ModelRespondedEvent(
                    **env,
                    payload=ModelResponded(
                        request_id=f"r{turn}",
                        segment_index=0,
                        turn_index=turn,
                        checkpoint_id="moe-base",
                        prompt_token_ids=pending[i],
                        completion_token_ids=g.token_ids,
                        completion_logprobs=g.logprobs,
                        latency_s=g.latency_s,
                        finish_reason=g.finish_reason,
                        routed_experts=np.asarray(g.routed_experts).reshape(-1).tolist(),
                        routed_experts_shape=(layers, k),
                    ),
                )
            )
            contexts[i] += pending[i] + g.token_ids
            pending[i] = rng.integers(300, 40_000, size=int(rng.integers(8, 24))).tolist()  # the tool's output
    events += [SessionEndedEvent(**e, payload=SessionEnded(turns=2)) for e in envs]
    return events


def route_differences(model, batches, config) -> tuple[float, float, float]:
    """(KL(behaviour || trainer) per sampled token, fraction of sampled tokens whose expert set differs
    from the recorded one in some layer, fraction of (token, layer) decisions that differ)."""
    used: list[torch.Tensor] = []
    experts = [layer.mlp.experts for layer in model.model.layers]
    hooks = [e.register_forward_pre_hook(lambda m, args: used.append(args[1])) for e in experts]
    try:
        stats = compute_old_logprobs(model, batches, config)
    finally:
        for h in hooks:
            h.remove()
    tokens = layers_differ = tokens_differ = 0
    for i, mb in enumerate(batches):
        ids = torch.stack(used[i * len(experts) : (i + 1) * len(experts)], dim=1).reshape(mb.routes.shape)
        at = mb.hidden_index  # the positions whose output sampled each trainable token
        got = ids.reshape(-1, *ids.shape[2:])[at].sort(-1).values
        want = mb.routes.reshape(-1, *mb.routes.shape[2:])[at].sort(-1).values
        differ = (got != want).any(-1)  # [N, layers]
        tokens += len(at)
        layers_differ += int(differ.sum())
        tokens_differ += int(differ.any(-1).sum())
    return stats["mismatch_kl"], tokens_differ / tokens, layers_differ / (tokens * len(experts))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="24 sessions of 2 x 32 tokens, 4 MoE layers")
    ap.add_argument("--sessions", type=int, default=None)
    ap.add_argument("--max-tokens", type=int, default=None, help="completion tokens per turn")
    ap.add_argument("--layers", type=int, default=None)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--init-std", type=float, default=None, help="std of the random MoE's init (hidden ** -0.5)")
    args = ap.parse_args()
    n_sessions = args.sessions or (24 if args.quick else 96)
    max_tokens = args.max_tokens or (32 if args.quick else 64)
    layers = args.layers or (4 if args.quick else 8)
    init_std = args.init_std if args.init_std is not None else args.hidden**-0.5
    started = time.monotonic()

    torch.set_num_threads(args.threads)
    tmp = Path(tempfile.mkdtemp(prefix="flywheel-bench-routes-"))
    os.environ["FLYWHEEL_HOME"] = str(tmp)
    os.environ.setdefault("FLYWHEEL_TELEMETRY_EXPORTER", "none")

    broker = start_broker(tmp / "logs")
    url, cleanup = _scratch(tmp)
    try:
        topic = f"bench.routes.{uuid.uuid4().hex[:6]}"
        os.environ.update(
            FLYWHEEL_DATABASE_URL=url,
            FLYWHEEL_KAFKA_BOOTSTRAP=broker.bootstrap,
            FLYWHEEL_KAFKA_INTERACTIONS_TOPIC=topic,
            FLYWHEEL_KAFKA_DLQ_TOPIC=topic + ".dlq",
            FLYWHEEL_KAFKA_CONSUMER_GROUP=f"bench-routes-{uuid.uuid4().hex[:6]}",
        )

        get_settings.cache_clear()
        get_consumer_settings.cache_clear()
        reset_engines()
        create_topics(broker.bootstrap, {topic: 2, topic + ".dlq": 1})

        model_dir = build_tiny_moe(
            tmp / "moe", experts=8, top_k=2, num_layers=layers, hidden_size=args.hidden, initializer_range=init_std
        )
        engine = ReferenceEngine(model_dir, checkpoint_id="moe-base")  # bf16-rounded weights
        t = time.monotonic()
        events = generate_sessions(engine, n_sessions, max_tokens, seed=0)
        generate_s = time.monotonic() - t
        del engine

        t = time.monotonic()
        producer = EventProducer(spool_dir=tmp / "spool")
        for e in events:
            producer.emit(e)
        producer.flush(timeout_s=60)
        producer.close()

        stats = IngestConsumer().run(idle_exit_s=2.0)
        ingest_s = time.monotonic() - t
        if stats.stored != len(events):
            raise SystemExit(f"the consumer stored {stats.stored} of {len(events)} events (see its log)")

        with session_scope() as s:
            add_checkpoint(s, checkpoint_id="moe-base", path=str(model_dir), status=CheckpointStatus.PRODUCTION)
        with session_scope() as s:
            route_bytes, completion_tokens = (
                s.connection()
                .exec_driver_sql(
                    "SELECT sum(octet_length(routed_experts)), sum(num_completion_tokens) FROM trajectory_segment"
                )
                .one()
            )
            config = TrainerConfig.model_validate({"loss": {"temperature": 1.0}, "data": {"max_seq_len": 4096}})
            data = select_cycle_data(s, config.data, s.get(Checkpoint, "moe-base"))
        if len(data.used) != n_sessions:
            raise SystemExit(f"{len(data.used)} of {n_sessions} trajectories usable: {data.excluded_counts()}")
        batches = pack_micro_batches(data.used, torch.zeros(len(data.used)), micro_batch_tokens=2048, pad_id=2)

        trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32, unrounded
        t = time.monotonic()
        kl_without, tok_without, dec_without = route_differences(
            trainer, batches, config.model_copy(update={"router_replay": False})
        )
        kl_with, tok_with, dec_with = route_differences(trainer, batches, config)
        score_s = time.monotonic() - t

        ratio = kl_with / kl_without if kl_without > 0 else float("inf")
        n_tok = sum(mb.num_trainable for mb in batches)
        print(
            f"# {n_sessions} sessions, {n_tok} sampled tokens, {layers} MoE layers x top-2 of 8 experts; "
            f"KL without replay {kl_without:.3g}, with {kl_with:.3g}; tokens with another expert set "
            f"{tok_without:.1%} -> {tok_with:.1%}; generate {generate_s:.1f}s, ingest {ingest_s:.1f}s, "
            f"score {score_s:.1f}s",
            file=sys.stderr,
        )
        print(
            json.dumps(
                {
                    "bench": "router_replay",
                    "ours": float(f"{kl_with:.4g}"),
                    "baseline": float(f"{kl_without:.4g}"),
                    "unit": "nats/token KL(behaviour||trainer)",
                    "ratio": round(ratio, 4),
                    "target": TARGET,
                    "pass": ratio <= TARGET,
                    "route_differ_token_frac_without": round(tok_without, 4),
                    "route_differ_token_frac_with": round(tok_with, 4),
                    "route_differ_decision_frac_without": round(dec_without, 4),
                    "route_differ_decision_frac_with": round(dec_with, 4),
                    "route_bytes_per_token": round(route_bytes / completion_tokens, 2),
                    "route_bytes_one_per_entry": layers * 2,
                    "sessions": n_sessions,
                    "sampled_tokens": n_tok,
                    "moe_layers": layers,
                    "experts": 8,
                    "top_k": 2,
                    "hidden": args.hidden,
                    "init_std": round(init_std, 4),
                    "seconds": round(time.monotonic() - started, 1),
                }
            )
        )
    finally:
        cleanup()
        stop_pid(broker.pid)


if __name__ == "__main__":
    main()

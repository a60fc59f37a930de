"""MoE routes through the real event path: producer bytes -> broker -> consumer group -> Postgres
(``trajectory_segment.routed_experts``), rebuilt identically by a replay of ``event_log``, loaded by
the trainer aligned with the tokens they sampled; an event with out-of-range expert ids is
dead-lettered with its reason."""

from __future__ import annotations

import base64
import json
import uuid

import numpy as np
import psycopg
import pytest
import torch

from app.models.checkpoints import CheckpointStatus
from consumers.testing import kafka_record, produce
from producers.events.types import (
    ModelResponded,
    ModelRespondedEvent,
    SessionEnded,
    SessionEndedEvent,
    SessionStarted,
    SessionStartedEvent,
)

pytestmark = pytest.mark.integration

LAYERS, TOP_K = 3, 2


@pytest.fixture(autouse=True)
def _own_consumer_group(monkeypatch):
    monkeypatch.setenv("FLYWHEEL_KAFKA_CONSUMER_GROUP", f"ingest-{uuid.uuid4().hex[:8]}")


def _session(i: int, rng: np.random.Generator, max_expert: int):
    """Events of one two-turn MoE session and each turn's (prompt, completion, routes)."""
    env = dict(session_id=f"moe-{i}", user_id=f"u{i}")
    turns, events = [], [SessionStartedEvent(**env, payload=SessionStarted(task_id=f"t{i}", checkpoint_id="base"))]
    for turn in range(2):
        prompt = rng.integers(10, 1000, size=4 + turn).tolist()
        completion = rng.integers(10, 1000, size=3 + i).tolist()
        routes = rng.integers(0, max_expert, size=(len(completion), LAYERS, TOP_K))
        turns.append((prompt, completion, routes))
        events.append(
            ModelRespondedEvent(
                **env,
                payload=ModelResponded(
                    request_id=f"r{turn}",
                    segment_index=0,
                    turn_index=turn,
                    checkpoint_id="base",
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=[-1.0] * len(completion),
                    latency_s=0.2,
                    routed_experts=routes.reshape(-1).tolist(),
                    routed_experts_shape=(LAYERS, TOP_K),
                ),
            )
        )
    events.append(SessionEndedEvent(**env, payload=SessionEnded(turns=2)))
    return events, turns


def _negative_ids_record(event: ModelRespondedEvent):
    """``event``'s wire bytes with its first expert id rewritten to -1 (what a buggy producer sends)."""
    key, value, headers = kafka_record(event)
    doc = json.loads(value)
    ids = np.frombuffer(base64.b64decode(doc["payload"]["routed_experts"]), dtype="<i4").copy()
    ids[0] = -1
    doc["payload"]["routed_experts"] = base64.b64encode(ids.tobytes()).decode()
    return key, json.dumps(doc).encode(), headers


def test_routes_survive_the_event_path_replay_and_trainer_loading(db, topics, kafka_bootstrap):
    from app.core.db import session_scope
    from app.models import Checkpoint
    from app.repositories.checkpoints import add_checkpoint
    from app.repositories.trajectories import unpack_routes
    from consumers.ingest import IngestConsumer, projector_from_settings
    from consumers.replay import compare_projections, drop_schema, dump_projection, replay
    from trainer.batching import pack_micro_batches
    from trainer.config import DataConfig
    from trainer.selection import select_cycle_data

    rng = np.random.default_rng(0)
    sessions = [_session(i, rng, 8 if i else 300) for i in range(3)]  # session 0 needs two bytes an id
    events = [e for evs, _ in sessions for e in evs]
    bad = _negative_ids_record(sessions[1][0][1])
    produce(kafka_bootstrap, topics["interactions"], [kafka_record(e) for e in events] + [bad])
    stats = IngestConsumer().run(idle_exit_s=2.0)
    assert stats.stored == len(events)

    with psycopg.connect(db) as conn:
        rows = {
            sid: (bytes(raw), shape, size)
            for sid, raw, shape, size in conn.execute(
                "SELECT t.session_id, s.routed_experts, s.routed_experts_shape, s.routed_experts_itemsize "
                "FROM trajectory_segment s JOIN trajectory t ON t.id = s.trajectory_id"
            )
        }
        dead = conn.execute("SELECT reason, detail FROM dead_letter").fetchall()
    assert len(dead) == 1 and dead[0][0] == "implausible" and "routed_experts: id" in dead[0][1]
    for i, (_, turns) in enumerate(sessions):
        raw, shape, size = rows[f"moe-{i}"]
        expect = np.concatenate([r for _, _, r in turns])
        assert shape == [LAYERS, TOP_K] and size == (2 if i == 0 else 1)
        assert len(raw) == expect.size * size
        assert unpack_routes(raw, size).tolist() == expect.reshape(-1).tolist()

    # a replay of event_log (into a shadow schema, then in place) rebuilds the same routes
    with session_scope() as s:
        live = dump_projection(s)
    replay(projector_from_settings(), grace_s=0.0, schema="routes_check")
    with session_scope() as s:
        shadow = dump_projection(s, "routes_check")
        drop_schema(s, "routes_check")
    assert "routed_experts" in live["trajectory_segment"].columns
    assert compare_projections(live, shadow) == []
    replay(projector_from_settings(), grace_s=0.0)
    with session_scope() as s:
        assert compare_projections(live, dump_projection(s)) == []

    # the trainer loads them on the tokens they sampled, and packs them one position to the left
    with session_scope() as s:
        add_checkpoint(s, checkpoint_id="base", path="/nowhere/base", status=CheckpointStatus.PRODUCTION)
    with session_scope() as s:
        data = select_cycle_data(s, DataConfig(), s.get(Checkpoint, "base"))
    assert len(data.used) == 3, data.excluded
    by_session = {t.session_id: t for t in data.used}
    for i, (_, turns) in enumerate(sessions):
        seg = by_session[f"moe-{i}"].segments[0]
        mask = seg.loss_mask.astype(bool)
        assert seg.routed_experts.shape == (len(seg.token_ids), LAYERS, TOP_K)
        assert (seg.routed_experts[~mask] == -1).all()
        assert seg.routed_experts[mask].tolist() == np.concatenate([r for _, _, r in turns]).tolist()
    trajs = [by_session[f"moe-{i}"] for i in range(3)]
    for mb in pack_micro_batches(trajs, torch.zeros(3), micro_batch_tokens=10_000):
        width = mb.input_ids.shape[1]
        rows_, cols = mb.hidden_index // width, mb.hidden_index % width
        sampled = mb.routes[rows_, cols]  # routes at the positions predicting each trainable token
        expect = [trajs[int(t)].segments[0].routed_experts[int(c) + 1] for t, c in zip(mb.trajectory_index, cols)]
        assert sampled.tolist() == np.stack(expect).tolist()
        assert int((mb.routes >= 0).all(-1).all(-1).sum()) == mb.num_trainable

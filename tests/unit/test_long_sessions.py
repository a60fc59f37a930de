"""Long sessions: ``functions_long`` tasks (long files, long tool output, multi-step requests), a tiny
real model driven through the product harness until it self-summarizes, and the trainer giving
every segment of such a trajectory the trajectory's one advantage."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
import torch
from transformers import AutoTokenizer

from app.checkpoints.testing import build_tiny_model
from app.inference.engine import SamplingParams
from consumers.projection import ProjectionConfig, Projector, StoredEvent
from consumers.rewards import load_spec
from consumers.trajectory_state import new_trajectory
from evals.harness.agent import AgentBudget, run_agent_session
from evals.harness.chat import ChatML, repository_message
from evals.harness.workspace import write_files
from evals.tasks import functions, functions_long, load_tasks, verify_reference, verify_stub
from ops.demo import LONG_SEGMENT_TOKENS
from ops.simulator import LONG_SESSION_MIN_TURNS, PRODUCTION_MIX, SimulatorConfig, run_simulation
from producers.events.packing import unpack_floats, unpack_ints
from serving.reference_engine import ReferenceEngine
from trainer.config import TrainerConfig
from trainer.data import Segment, TrajectoryData
from trainer.training import pack_cycle

SIMULATOR = SimulatorConfig()  # the simulator's default session budget
SIMULATOR_CONTEXT = SIMULATOR.context_tokens


@pytest.fixture(scope="module")
def long_context_model(tmp_path_factory):
    """A tiny random Llama (SmolLM2 tokenizer) with room for positions past the simulator's context."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-long"), seed=0, max_position_embeddings=4096)


@pytest.fixture(scope="module")
def chat(long_context_model) -> ChatML:
    return ChatML(AutoTokenizer.from_pretrained(long_context_model))


def test_long_tasks_are_solvable_multi_step_and_shown_whole_in_a_long_first_turn(chat, tmp_path):
    train, test = functions_long.load("train"), functions_long.load("test")
    assert load_tasks("functions_long", "train") == train and len(train) == 53 and len(test) == 37
    held = functions.held_out_templates()
    assert all(set(t.metadata["templates"]) <= held for t in test)
    assert not any(set(t.metadata["templates"]) & held for t in train)
    for task in (train[0], train[41], test[0]):
        assert verify_reference(task).ok and not verify_stub(task).ok
        names = task.metadata["entry_points"]
        assert len(set(names)) == functions_long.STEPS and [f.entry_point for f in task.followups] == names[1:]
        repo = tmp_path / task.id.replace("/", "_")
        write_files(repo, task.files)
        first = repository_message(task.request, repo)
        assert all(text.rstrip() in first for text in task.files.values())  # every file inline, whole
        assert len(chat.first_prompt(chat.system_prompt, first)) > 2 * SIMULATOR_CONTEXT // 3
        # the follow-ups paste run_checks.py's real output for their stub (a long tool output)
        ran = subprocess.run([sys.executable, "run_checks.py"], cwd=repo, capture_output=True, text=True, timeout=60)
        printed = ran.stdout.replace(f"{repo.resolve()}/", "")
        for step in task.followups:
            pasted = step.request.split("```\n", 1)[1].rsplit("\n```", 1)[0]
            assert pasted in printed and len(chat.encode(pasted)) > 150


def _fold(events) -> tuple:
    """The trajectory the consumers project from a session's events, and its reward (implicit@1)."""
    start = datetime(2026, 1, 1, tzinfo=UTC)
    stored = [StoredEvent(e, i + 1, start + timedelta(seconds=i), "t", 0, i) for i, e in enumerate(events)]
    projector = Projector(ProjectionConfig(), [load_spec("implicit@1")])
    state = new_trajectory(stored[0].event)
    for se in stored:
        projector.apply(state, se)
    return state, projector.label(state)[0].reward


def _trajectory_data(state, reward: float, group: str) -> TrajectoryData:
    """The trainer's view of a projected trajectory (as ``trainer.selection`` loads it)."""
    segments = [
        Segment(
            unpack_ints(s.token_ids), np.frombuffer(bytes(s.loss_mask), np.uint8), unpack_floats(s.behaviour_logprobs)
        )
        for _, s in sorted(state.segments.items())
    ]
    return TrajectoryData(
        id=state.id,
        session_id=state.session_id,
        user_id=state.user_id,
        task_id=group,
        reward=reward,
        group=group,
        finalized_at=datetime.now(UTC),
        segments=segments,
        event_ids=[],
        offsets={},
        max_event_seq=None,
        serving_checkpoints=[],
    )


def test_a_tiny_model_on_a_long_task_self_summarizes_and_every_segment_trains_with_its_reward(
    long_context_model, tmp_path
):
    engine = ReferenceEngine(long_context_model, checkpoint_id="tiny", serving_dtype=None, device="cpu", num_threads=1)
    task = functions_long.load("train")[0]
    budget = AgentBudget(  # as the simulator builds it from its defaults
        max_turns=SIMULATOR.max_turns,
        max_completion_tokens=SIMULATOR.max_tokens,
        context_tokens=SIMULATOR.context_tokens,
        max_tokens_per_turn=SIMULATOR.max_tokens_per_turn,
    )
    try:
        long = run_agent_session(
            engine,
            task,
            tmp_path / "repo",
            budget,
            SamplingParams(max_tokens=SIMULATOR.max_tokens_per_turn, temperature=SIMULATOR.temperature, seed=0),
            session_id="long-0",
            user_id="u",
        )
    finally:
        engine.close()
    types = [e.type for e in long.events]
    assert long.segments > 1 and types.count("context.summarized") == long.segments - 1
    assert types.count("agent.requested") == 1 + len(task.followups)  # every step was asked
    assert [e.payload.request_id for e in long.events if e.type == "agent.requested"] == ["r0", "r1", "r2"]
    segment_tokens: dict[int, int] = {}
    for e in long.events:
        if e.type == "model.responded":
            p = e.payload
            n = len(p.prompt_token_ids) + len(p.completion_token_ids)
            segment_tokens[p.segment_index] = segment_tokens.get(p.segment_index, 0) + n
    assert max(segment_tokens.values()) <= SIMULATOR_CONTEXT + budget.summary_tokens + 64  # + the summary turn

    # projected like the consumers do: one trajectory, one reward, several segments
    state, reward = _fold(long.events)
    assert state.num_segments == long.segments > 1
    # beside a one-segment session on the same task with another reward, so the advantage is not 0
    other = _trajectory_data(state, reward + 1.0, group="FNL")
    other.segments = [
        Segment(
            np.arange(1, 9, dtype=np.int32), np.array([0, 0, 0, 1, 1, 1, 1, 1], np.uint8), np.full(8, -0.5, np.float32)
        )
    ]
    trajectories = [_trajectory_data(state, reward, group="FNL"), other]
    config = TrainerConfig.model_validate({"data": {"micro_batch_tokens": 4096}})
    _, _, advantages, batches = pack_cycle(trajectories, config)
    assert float(advantages[0]) == pytest.approx(-0.5)  # reward minus the mean reward of its task's group
    rows, tokens = set(), 0
    for b in batches:
        mine = b.trajectory_index == 0
        assert torch.all(b.advantages[mine] == advantages[0])  # every token of every segment: one advantage
        width = b.input_ids.shape[1]
        rows |= {(id(b), int(r)) for r in (b.hidden_index[mine] // width).unique()}
        tokens += int(mine.sum())
    assert len(rows) == state.num_segments  # each segment is a row of its own
    assert tokens == sum(int(s.loss_mask[1:].sum()) for s in trajectories[0].segments)


def test_long_sessions_in_simulated_traffic_summarize_under_the_demos_two_turns(long_context_model):
    """``long_session_share`` through the real simulator: at the demo's and the bench's budget (2
    turns of 160 tokens) a long group's sessions get the turns to self-summarize, and each segment
    fits the segment length the demo's trainer keeps (the trainer's default keeps none of them)."""
    engine = ReferenceEngine(long_context_model, checkpoint_id="tiny", serving_dtype=None, device="cpu", num_threads=1)
    config = SimulatorConfig(
        sessions=1,
        group_size=1,
        source="functions",
        difficulty_mix=PRODUCTION_MIX,
        max_turns=2,
        max_tokens_per_turn=160,
        max_tokens=320,
        long_session_share=1.0,
        persistence_delay_s=0,
        followup_delay_s=0,
    )
    events = []
    try:
        summaries = run_simulation(config, engine, events.append)
    finally:
        engine.close()
    assert [s.get("error") for s in summaries] == [None]
    assert summaries[0]["task_id"].startswith("FNL/train/")
    assert all(2 < s["turns"] <= LONG_SESSION_MIN_TURNS and s["segments"] > 1 for s in summaries)
    default_seq_len = TrainerConfig().data.max_seq_len
    for s in summaries:
        state, _ = _fold([e for e in events if e.session_id == s["session_id"]])
        assert state.num_segments > 1  # what the loop report counts as a multi-segment session
        # a session whose budget ends right after a summary leaves its last segment empty (no turn ran
        # in it): seen since the report and fresh splits changed the long tasks' fillers (2026-12-02)
        for seg in [seg for seg in _trajectory_data(state, 0.0, group="FNL").segments if len(seg.token_ids)]:
            assert len(seg.token_ids) <= LONG_SEGMENT_TOKENS
            assert int(np.argmax(seg.loss_mask)) > default_seq_len  # its first sampled token

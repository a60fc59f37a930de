"""The editor simulator end to end: sessions on training tasks, events through the real broker."""

from __future__ import annotations

import time
from collections import Counter, defaultdict

import pytest

from app.inference.engine import Generation, InferenceEngine, SamplingParams
from evals.harness.scripted import tool_call
from ops.developer import DeveloperModel, surviving_fraction, visible_check
from ops.simulator import SimulatorConfig, run_simulation
from producers.events import decode_event


class OraclePolicy(InferenceEngine):
    """Per prompt: on the first turn, write the task's reference (or a broken solution for every
    other request it sees), then finish. Deterministic, log-prob 0."""

    def __init__(self, tokenizer, tasks) -> None:
        self.tokenizer, self.tasks, self.checkpoint_id, self.calls = tokenizer, tasks, "oracle", 0
        self.end = tokenizer.convert_tokens_to_ids("<|im_end|>")

    def generate(self, prompts, params: SamplingParams):
        out = []
        for prompt in prompts:
            text = self.tokenizer.decode(prompt)
            if text.count("<|im_start|>assistant") > 1 or "Summary of your work so far" in text:
                reply = tool_call("finish", message="done")
            else:
                task = next(t for t in self.tasks if t.request.strip()[:200] in text)
                self.calls += 1
                good = self.calls % 2 == 1
                content = task.reference_files["solution.py"] if good else "def task_func(*a, **k):\n    return None\n"
                reply = tool_call("edit_file", path="solution.py", content=content)
            ids = self.tokenizer(reply, add_special_tokens=False).input_ids + [self.end]
            out.append(Generation(token_ids=ids, logprobs=[0.0] * len(ids), finish_reason="stop", latency_s=0.01))
        return out

    def load_checkpoint(self, checkpoint_id, path):
        self.checkpoint_id = checkpoint_id

    def apply_delta(self, checkpoint_id, delta_path, parent_id):
        self.checkpoint_id = checkpoint_id


def consume(bootstrap, topic, expected, timeout_s=60.0):
    from kafka import KafkaConsumer, TopicPartition

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False, auto_offset_reset="earliest")
    try:
        parts = None
        deadline = time.monotonic() + timeout_s
        while not parts and time.monotonic() < deadline:
            parts = consumer.partitions_for_topic(topic) or None
            time.sleep(0.1)
        consumer.assign([TopicPartition(topic, p) for p in sorted(parts)])
        out = []
        while len(out) < expected and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                out.extend(decode_event(r.value) for r in records)
        return out
    finally:
        consumer.close()


@pytest.mark.integration
def test_simulated_sessions_reach_the_broker_with_their_late_signals(
    kafka_bootstrap, topics, tiny_model_dir, tmp_path, monkeypatch
):
    from transformers import AutoTokenizer

    from evals.tasks import load_tasks
    from producers.producer import EventProducer

    config = SimulatorConfig(
        sessions=4,
        group_size=2,
        max_turns=3,
        max_tokens=4096,
        max_tokens_per_turn=2048,
        context_tokens=6144,
        privacy_rate=0.5,
        developer=DeveloperModel(
            accept_if_works=1.0,
            accept_if_looks_right=1.0,
            keep_if_works=(1.0, 1.0),
            followup_if_works=0.0,
            followup_if_fails=1.0,
        ),
        persistence_delay_s=0.5,
        followup_delay_s=0.2,
        seed=3,
    )
    tasks = load_tasks("dataframebench", "train", limit=2, seed=3)
    engine = OraclePolicy(AutoTokenizer.from_pretrained(tiny_model_dir), tasks)
    with EventProducer(spool_dir=tmp_path / "spool") as producer:
        summaries = run_simulation(config, engine, producer.emit)
        producer.flush(timeout_s=30)
        sent = producer.metrics["sent"]
    assert len(summaries) == 4 and not any("error" in s for s in summaries)
    assert Counter(s["task_id"] for s in summaries) == {t.id: 2 for t in tasks}  # groups of 2 per task
    assert sorted(s["passed"] for s in summaries) == [False, False, True, True], summaries

    events = consume(kafka_bootstrap, topics["interactions"], sent)
    assert len(events) == sent
    by_session = defaultdict(list)
    for e in events:
        by_session[e.session_id].append(e)
    assert set(by_session) == {s["session_id"] for s in summaries}
    for s in summaries:
        evs = by_session[s["session_id"]]  # one session = one key = one partition: in order
        types = [e.type for e in evs]
        assert types[0] == "session.started" and "model.responded" in types
        assert {e.privacy_mode for e in evs} == {s["privacy_mode"]}
        end = types.index("session.ended")
        late = Counter(types[end + 1 :])
        assert late == Counter(evs[end].payload.expected_signals)  # exactly what session.ended announced
        fractions = [e.payload.fraction_persisted for e in evs if e.type == "edit.persistence_measured"]
        assert fractions, "the accepted edit's persistence was measured"
        if s["passed"]:
            assert fractions == [1.0] and "followup.sent" not in late
        else:
            assert all(f <= 0.3 for f in fractions)
            assert [e.payload.dissatisfied for e in evs if e.type == "followup.sent"] == [True]
    assert {s["privacy_mode"] for s in summaries} == {True, False}


def test_simulator_refuses_eval_splits():
    from app.core.errors import ConfigurationError

    with pytest.raises(ConfigurationError, match="training tasks only"):
        run_simulation(SimulatorConfig(split="test"), engine=None, emit=lambda e: None)


def test_surviving_fraction_counts_added_lines_left():
    edit = {"added": ["a = 1", "b = 2", "", "c = 3"]}
    assert surviving_fraction(edit, "a = 1\nc = 3\n") == pytest.approx(2 / 3)
    assert surviving_fraction({"added": []}, "") == 1.0


def test_simulator_runs_the_real_torch_engine(tiny_model_dir):
    """A tiny random model through the whole simulator (no broker): real token ids and log-probs."""
    from serving.reference_engine import ReferenceEngine

    engine = ReferenceEngine(tiny_model_dir, checkpoint_id="tiny", num_threads=1)
    events = []
    summaries = run_simulation(
        SimulatorConfig(
            sessions=2, group_size=2, max_turns=2, max_tokens=32, max_tokens_per_turn=16, persistence_delay_s=0, seed=1
        ),
        engine,
        events.append,
    )
    assert len(summaries) == 2 and all("error" not in s for s in summaries)
    responded = [e for e in events if e.type == "model.responded"]
    assert responded and all(e.payload.checkpoint_id == "tiny" for e in responded)
    assert all(len(e.payload.completion_logprobs) == len(e.payload.completion_token_ids) > 0 for e in responded)
    assert all(lp <= 0 for e in responded for lp in e.payload.completion_logprobs)
    assert Counter(e.type for e in events)["session.ended"] == 2


def test_visible_check_reads_the_main_file():
    from evals.tasks.model import Task

    task = Task(
        id="t",
        source="x",
        split="train",
        request="r",
        files={"solution.py": "def f():\n    pass\n"},
        test_command="true",
        metadata={"entry_point": "f"},
    )
    assert visible_check(task, {"solution.py": "def f(x):\n    return x\n"})
    assert not visible_check(task, {"solution.py": "def g(x):\n    return x\n"})  # not the requested function
    assert not visible_check(task, {"solution.py": "def f(x:\n"})  # does not parse
    assert not visible_check(task, {})


def test_developer_model_follows_outcomes():
    dev = DeveloperModel()
    assert dev.accept_probability("works") > dev.accept_probability("looks_right") > dev.accept_probability("broken")
    assert dev.followup_probability("works") < dev.followup_probability("looks_right")
    assert dev.followup_probability("no_edit") > dev.followup_probability("works")
    with pytest.raises(ValueError):
        DeveloperModel(accept_if_works=1.5)

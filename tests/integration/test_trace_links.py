"""One promotion's trace links, on real Postgres: from the promotion span back through the gate
decision and its eval runs to the training cycle, from there to the producer spans that emitted
the events of the trajectories it trained on, and forward to serving's reload span."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import numpy as np
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from app.core.telemetry import inject_headers, span_reference
from app.lifecycle.messages import parse_lifecycle_message
from app.models import Checkpoint, Outbox, Trajectory
from app.outbox.relay import outbox_message
from app.promotion.service import promote_checkpoint
from consumers.batch import apply_batch
from consumers.classify import Message, classify
from consumers.ingest import projector_from_settings
from consumers.testing import generate_session, kafka_record
from evals import runner
from serving.watcher import ProductionFollower
from tests.integration.test_api_support import base, seed_checkpoint, store  # noqa: F401
from tests.integration.test_eval_gating import Policies, gate
from tests.unit.test_api_units import RecordingEngine
from trainer.config import DataConfig
from trainer.selection import select_cycle_data
from trainer.trace_links import link_producer_spans

pytestmark = pytest.mark.integration


@pytest.fixture
def spans(monkeypatch) -> InMemorySpanExporter:
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)
    return exporter


def _linked(span, finished, name: str) -> list:
    """The finished spans named ``name`` that ``span`` links to."""
    targets = {(link.context.trace_id, link.context.span_id) for link in span.links}
    return [s for s in finished if s.name == name and (s.context.trace_id, s.context.span_id) in targets]


def _ingest_traced_sessions(session, n: int) -> dict[str, int]:
    """``n`` sessions on one task, each emitted inside its own producer span (the product backend's),
    through the consumer's classify and batch path; ``{session_id: producer span id}``."""
    rng, start = np.random.default_rng(7), datetime.now(UTC) - timedelta(minutes=30)
    messages, emitted_by = [], {}
    for k in range(n):
        events = generate_session(rng, session_id=f"s-{k}", user_id=f"u-{k}", start=start, task_id="task-0")
        with trace.get_tracer("backend").start_as_current_span("backend.session") as span:
            for e in events:
                key, value, _ = kafka_record(e)
                messages.append(Message("t", 0, len(messages), key, value, inject_headers()))
        emitted_by[f"s-{k}"] = span.get_span_context().span_id
    apply_batch(session, "g", [classify(m, 1 << 20) for m in messages], projector_from_settings())
    session.commit()
    return emitted_by


def test_a_promotion_links_back_to_its_training_cycle_and_producers_and_forward_to_the_reload(
    session, store, base, spans, monkeypatch, tmp_path
):
    emitted_by = _ingest_traced_sessions(session, 3)
    # the training cycle links to the producer spans of what it trains on and stores its span's
    # reference in the candidate's manifest (trainer/cycle.py)
    with trace.get_tracer("test").start_as_current_span("trainer.cycle"):
        data = select_cycle_data(session, DataConfig(), session.get(Checkpoint, "base"))
        assert len(data.used) == 3, data.excluded
        assert link_producer_spans(session, data.used) == 3
        cycle_reference = span_reference()
    row = seed_checkpoint(session, store, "good", parent_id="base", generation=1)
    row.manifest = {**row.manifest, "trace": cycle_reference}
    session.commit()
    monkeypatch.setattr(runner, "run_sample", Policies())
    assert gate("good", production_id="base").result.passed
    session.expire_all()
    promote_checkpoint(session, checkpoint_id="good", expected_production_id="base", actor="alice", reason="gate")
    session.commit()
    (message,) = session.scalars(select(Outbox).where(Outbox.event_type == "checkpoint.promoted")).all()
    _, value, headers = outbox_message(message)
    engine = RecordingEngine("base")
    ProductionFollower(engine, store=store, home=tmp_path).handle_batch([(parse_lifecycle_message(value), headers)])
    assert engine.calls == [("full", "good")]

    finished = spans.get_finished_spans()
    (promotion,) = [s for s in finished if s.name == "promotion.promote"]
    (gate_span,) = _linked(promotion, finished, "evals.gate")
    runs = _linked(gate_span, finished, "evals.run")
    assert {r.attributes["flywheel.checkpoint_id"] for r in runs} == {"good", "base"}
    assert len(runs) == 4  # two suites, candidate and production
    candidate_runs = [r for r in runs if r.attributes["flywheel.checkpoint_id"] == "good"]
    (cycle,) = {c.context.span_id: c for r in candidate_runs for c in _linked(r, finished, "trainer.cycle")}.values()
    assert span_reference(trace.NonRecordingSpan(cycle.context)) == cycle_reference
    producers = _linked(cycle, finished, "backend.session")
    sessions = {str(t.id): t.session_id for t in session.scalars(select(Trajectory))}
    assert {p.context.span_id for p in producers} == set(emitted_by.values())
    for link in cycle.links:  # each link names a trained trajectory and the span that emitted its event
        assert emitted_by[sessions[link.attributes["flywheel.trajectory_id"]]] == link.context.span_id
    assert cycle.attributes["flywheel.producer_spans"] == cycle.attributes["flywheel.producer_spans.linked"] == 3
    (reload,) = [s for s in finished if s.name == "serving.reload"]
    assert reload.parent.span_id == promotion.context.span_id and reload.context.trace_id == promotion.context.trace_id
    assert reload.attributes["flywheel.checkpoint_id"] == "good" and reload.attributes["flywheel.method"] == "full"
    assert session.get(Checkpoint, "good").status == "production"

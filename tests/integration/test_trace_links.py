"""One promotion's trace links, on real Postgres: from the promotion span back through the gate
decision and its eval runs to the training cycle, and forward to serving's reload span."""

from __future__ import annotations

import json

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from sqlalchemy import select

from app.core.telemetry import span_reference
from app.models import Checkpoint, Outbox
from app.outbox.relay import outbox_message
from app.promotion.service import promote_checkpoint
from evals import runner
from serving.watcher import ProductionFollower
from tests.integration.test_api_support import base, seed_checkpoint, store  # noqa: F401
from tests.integration.test_eval_gating import Policies, gate
from tests.unit.test_api_units import RecordingEngine

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


def test_a_promotion_links_back_to_its_training_cycle_and_forward_to_the_reload(
    session, store, base, spans, monkeypatch, tmp_path
):
    # the training cycle stores its span's reference in the candidate's manifest (trainer/cycle.py)
    with trace.get_tracer("test").start_as_current_span("trainer.cycle"):
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
    ProductionFollower(engine, store=store, home=tmp_path).handle_batch([(json.loads(value), headers)])
    assert engine.calls == [("delta", "good")]

    finished = spans.get_finished_spans()
    (promotion,) = [s for s in finished if s.name == "promotion.promote"]
    (gate_span,) = _linked(promotion, finished, "evals.gate")
    runs = _linked(gate_span, finished, "evals.run")
    assert {r.attributes["flywheel.checkpoint_id"] for r in runs} == {"good", "base"}
    assert len(runs) == 4  # two suites, candidate and production
    candidate_runs = [r for r in runs if r.attributes["flywheel.checkpoint_id"] == "good"]
    (cycle,) = {c.context.span_id: c for r in candidate_runs for c in _linked(r, finished, "trainer.cycle")}.values()
    assert span_reference(trace.NonRecordingSpan(cycle.context)) == cycle_reference
    (reload,) = [s for s in finished if s.name == "serving.reload"]
    assert reload.parent.span_id == promotion.context.span_id and reload.context.trace_id == promotion.context.trace_id
    assert reload.attributes["flywheel.checkpoint_id"] == "good" and reload.attributes["flywheel.method"] == "delta"
    assert session.get(Checkpoint, "good").status == "production"

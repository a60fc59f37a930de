"""``traced`` puts a call in a span whose attributes name the checkpoints it touched."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from app.core.telemetry import traced


@pytest.fixture
def spans(monkeypatch):
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    monkeypatch.setattr(trace, "get_tracer", provider.get_tracer)
    return exporter


def test_traced_records_named_arguments_and_propagates_errors(spans):
    @traced("promotion.promote", attrs=("checkpoint_id", "expected_production_id"))
    def promote(session, *, checkpoint_id, expected_production_id=None, reason=""):
        if checkpoint_id == "bad":
            raise ValueError("refused")
        return checkpoint_id

    assert promote(None, checkpoint_id="ckpt-1", expected_production_id="base") == "ckpt-1"
    with pytest.raises(ValueError):
        promote(None, checkpoint_id="bad")
    finished = spans.get_finished_spans()
    assert [s.name for s in finished] == ["promotion.promote", "promotion.promote"]
    assert finished[0].attributes == {"flywheel.checkpoint_id": "ckpt-1", "flywheel.expected_production_id": "base"}
    assert finished[1].attributes == {"flywheel.checkpoint_id": "bad"}
    assert not finished[1].status.is_ok

"""The lifecycle's vocabulary and rules without a database: the status transitions, the status a gate
decision leaves, the typed lifecycle messages (round trip, tolerant reads, loud refusals), and the
API's literals kept equal to the enums."""

from __future__ import annotations

import json
from typing import get_args

import pytest

from app.api.schemas import CheckpointDecision, GateDecisionValue
from app.api.schemas import CheckpointStatus as ApiStatus
from app.core.errors import ConflictError
from app.lifecycle.messages import (
    CanaryStarted,
    GateDecided,
    LifecycleMessageError,
    ProductionChanged,
    parse_lifecycle_message,
)
from app.lifecycle.status import (
    GATEABLE,
    OVERRIDABLE,
    REJECTABLE,
    TRANSITIONS,
    CheckpointStatus,
    GateVerdict,
    move,
    status_after_gate,
    transition_refusal,
)
from app.models import Checkpoint
from app.models.checkpoints import CHECKPOINT_STATUSES, GATE_VERDICTS


def test_every_status_has_its_transitions_and_rejected_is_final():
    assert set(TRANSITIONS) == set(CheckpointStatus)
    assert TRANSITIONS[CheckpointStatus.REJECTED] == frozenset()
    assert GATEABLE == ("candidate", "gate_passed", "gate_failed")
    assert REJECTABLE == ("candidate", "gate_passed", "gate_failed")
    assert transition_refusal("retired", "production") is None  # a rollback
    refusal = transition_refusal("candidate", "production")
    assert refusal and "allowed: gate_failed, gate_passed, rejected" in refusal


def test_move_refuses_an_illegal_transition_and_leaves_the_row_alone():
    row = Checkpoint(id="c", status="rejected", path="/x")
    with pytest.raises(ConflictError) as exc:
        move(row, CheckpointStatus.PRODUCTION)
    assert row.status == "rejected" and "none (final)" in exc.value.reasons[0]
    row.status = "gate_passed"
    assert move(row, CheckpointStatus.PRODUCTION) == "gate_passed" and row.status == "production"


def test_only_a_pass_leaves_gate_passed_and_overridden_is_no_gate_decision():
    assert status_after_gate("pass") is CheckpointStatus.GATE_PASSED
    for decision in ("fail", "insufficient_evidence", "not_gated"):
        assert status_after_gate(decision) is CheckpointStatus.GATE_FAILED
    with pytest.raises(ValueError):
        status_after_gate("overridden")
    with pytest.raises(ValueError):
        status_after_gate("maybe")
    assert OVERRIDABLE == ("insufficient_evidence", "not_gated")


def test_the_api_speaks_the_enums():
    assert ApiStatus is CheckpointStatus and CheckpointDecision is GateVerdict
    assert set(get_args(GateDecisionValue)) == set(GateVerdict) - {GateVerdict.OVERRIDDEN}
    assert tuple(CheckpointStatus) == CHECKPOINT_STATUSES and tuple(GateVerdict) == GATE_VERDICTS


def test_a_message_round_trips_through_its_json_and_the_relays_outbox_id():
    sent = ProductionChanged(
        type="checkpoint.rolled_back",
        checkpoint_id="c1",
        actor="cli:ann",
        previous_production_id="c2",
        path="/ckpt/c1",
        lineage=[{"id": "c1", "path": "/ckpt/c1"}, {"id": "base", "path": "/ckpt/base"}],
    )
    wire = {**sent.model_dump(mode="json", exclude={"outbox_id"}), "outbox_id": 7}  # as the relay publishes
    got = parse_lifecycle_message(json.dumps(wire).encode())
    assert isinstance(got, ProductionChanged) and got.outbox_id == 7
    assert got.model_copy(update={"outbox_id": None}) == sent
    assert [e.id for e in got.lineage] == ["c1", "base"]


def test_readers_ignore_unknown_fields_and_refuse_what_they_cannot_use():
    gate = GateDecided(
        checkpoint_id="c1", production_id="base", decision_id="d", decision=GateVerdict.PASS, passed=True
    ).model_dump(mode="json")
    assert parse_lifecycle_message({**gate, "added_by_a_newer_writer": 1}).decision is GateVerdict.PASS
    bad = [
        (b"{not json", "not JSON"),
        (b"[1, 2]", "not a JSON object"),
        ({**gate, "type": "checkpoint.exploded"}, "unknown lifecycle message type"),
        ({k: v for k, v in gate.items() if k != "event_id"}, "without event_id"),
        ({**gate, "decision": "probably"}, "invalid gate.decided"),
        (
            CanaryStarted(checkpoint_id="c1", canary_id="k", fraction=0.1, production_id="base").model_dump(mode="json")
            | {"fraction": 1.5},
            "invalid canary.started",
        ),
    ]
    for raw, why in bad:
        with pytest.raises(LifecycleMessageError, match=why):
            parse_lifecycle_message(raw)

"""The allowed moves of a checkpoint's status, and the status a gate decision leaves.

Invariant: every write of ``checkpoint.status`` in ``app.lifecycle`` goes through :func:`move`, so a
status only ever changes along :data:`TRANSITIONS`; a refused move names the current status and
the allowed ones. The vocabulary itself (:class:`CheckpointStatus`, :class:`GateVerdict`) lives
with the table in ``app.models.checkpoints``, whose CHECK constraints hold the database to it.
"""

from __future__ import annotations

from app.core.errors import ConflictError
from app.models import Checkpoint
from app.models.checkpoints import CheckpointStatus, GateVerdict

__all__ = [
    "CheckpointStatus",
    "GATEABLE",
    "GateVerdict",
    "OVERRIDABLE",
    "REJECTABLE",
    "TRANSITIONS",
    "move",
    "status_after_gate",
    "transition_refusal",
]

S = CheckpointStatus

#: ``from -> {to}``. A gated checkpoint may be gated again (against a new production); only a
#: gated one is promoted (``gate_failed`` only with an override); ``retired`` returns to
#: ``production`` only by a rollback; ``rejected`` is final.
TRANSITIONS: dict[CheckpointStatus, frozenset[CheckpointStatus]] = {
    S.CANDIDATE: frozenset({S.GATE_PASSED, S.GATE_FAILED, S.REJECTED}),
    S.GATE_PASSED: frozenset({S.GATE_PASSED, S.GATE_FAILED, S.PRODUCTION, S.REJECTED}),
    S.GATE_FAILED: frozenset({S.GATE_PASSED, S.GATE_FAILED, S.PRODUCTION, S.REJECTED}),
    S.PRODUCTION: frozenset({S.RETIRED}),
    S.RETIRED: frozenset({S.PRODUCTION}),
    S.REJECTED: frozenset(),
}
#: Statuses a gate may decide on (a production, retired or rejected checkpoint is not re-gated).
GATEABLE: tuple[str, ...] = tuple(s.value for s, to in TRANSITIONS.items() if S.GATE_PASSED in to)
#: Statuses a release manager may reject.
REJECTABLE: tuple[str, ...] = tuple(s.value for s, to in TRANSITIONS.items() if S.REJECTED in to)
#: Gate decisions a release manager may promote over with a written reason (nothing failed).
OVERRIDABLE: tuple[str, ...] = (GateVerdict.INSUFFICIENT_EVIDENCE.value, GateVerdict.NOT_GATED.value)


def status_after_gate(decision: str) -> CheckpointStatus:
    """``gate_passed`` for a ``pass``, ``gate_failed`` for any other decision.

    Raises:
        ValueError: ``decision`` is not a gate decision (``overridden`` is not one a gate makes).
    """
    verdict = GateVerdict(decision)
    if verdict is GateVerdict.OVERRIDDEN:
        raise ValueError("overridden is a release manager's act, not a gate decision")
    return S.GATE_PASSED if verdict is GateVerdict.PASS else S.GATE_FAILED


def transition_refusal(current: str, target: str) -> str | None:
    """Why ``current -> target`` is not allowed, or None when it is."""
    allowed = TRANSITIONS[S(current)]
    if S(target) in allowed:
        return None
    names = ", ".join(sorted(s.value for s in allowed)) or "none (final)"
    return f"checkpoint status {current!r} cannot become {target!r} (allowed: {names})"


def move(row: Checkpoint, target: CheckpointStatus) -> str:
    """Set ``row.status`` to ``target`` (not flushed); returns the previous status.

    Raises:
        ConflictError: the move is not in :data:`TRANSITIONS`.
    """
    refusal = transition_refusal(row.status, target)
    if refusal is not None:
        raise ConflictError(f"checkpoint {row.id} cannot become {target.value}", reasons=[refusal])
    previous = row.status
    row.status = target.value
    return previous

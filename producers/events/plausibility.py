"""Physical plausibility of event values: what a schema type admits but no real session produces.

Invariant: an event that passes these checks cannot put a non-finite or positive log-prob, an
out-of-vocabulary token id, an empty model turn, or an absurd count, latency or timestamp into
``event_log`` (and so into a training step). The array checks are vectorised (numpy reductions
over the packed bytes, ~1 us a turn); a failure raises ``pydantic_core.PydanticCustomError`` of
type ``implausible`` whose message starts with the field's name, which the codec turns into the
dead-letter reason ``implausible`` (``producers.events.codec``).

The time window (:class:`TimeWindow`, :func:`check_occurred_at`) depends on the ingestion clock, so the ingest consumer
applies it (``consumers.classify.classify``), not the contract: replaying a months-old event
must still validate.
"""

from __future__ import annotations

from datetime import datetime, timedelta
from typing import NamedTuple, Protocol

import numpy as np
from pydantic_core import PydanticCustomError

MAX_VOCAB_SIZE = 2_097_152
"""Largest vocabulary accepted (2^21; the largest open models have ~262k entries)."""
MAX_TURN_INDEX = 100_000
"""Largest turn index (and turns per session) accepted."""
MAX_COUNT = 100_000_000
"""Largest line or token count accepted in a count field."""
MAX_LATENCY_S = 86_400.0
"""Longest model-turn latency or tool duration accepted (seconds: one day)."""
MAX_DELAY_S = 366 * 86_400.0
"""Longest delay of a late signal accepted (seconds: a year)."""
MAX_EXPERTS = 65_536
"""Expert ids (MoE routing) must be below this."""
MAX_LAYERS = 1024
"""Layers of a routed-experts record accepted."""
MAX_TOP_K = 64
"""Experts per token per layer accepted."""
LOGPROB_TOLERANCE = 1e-3
"""A log-prob may exceed 0 by this much (nats): float32 rounding of log-softmax near probability 1."""


def _implausible(message: str) -> PydanticCustomError:
    return PydanticCustomError("implausible", "{message}", {"message": message})


def _check_ids(name: str, ids: np.ndarray, high: int) -> None:
    """Raise for the first id of ``ids`` (shape ``[n]``, int32) outside ``[0, high)``, naming ``name``.

    Raises:
        PydanticCustomError: type ``implausible``, with the first bad index and value.
    """
    bad = np.flatnonzero((ids < 0) | (ids >= high))
    if bad.size:
        raise _implausible(f"{name}: id {int(ids[bad[0]])} at index {int(bad[0])} is outside [0, {high})")


class PackedValues(Protocol):
    """What the checks read of a ``producers.events.packing`` array: its bytes and a numpy view."""

    raw: bytes

    def __len__(self) -> int: ...

    def numpy(self) -> np.ndarray: ...


def check_model_turn(
    prompt_ids: PackedValues,
    completion_ids: PackedValues,
    logprobs: PackedValues,
    vocab_size: int,
    routed_experts: PackedValues | None = None,
) -> None:
    """Check one ``model.responded`` payload's arrays (``producers.events.packing`` arrays: ``raw`` holds
    little-endian ``<i4`` ids / ``<f4`` log-probs in nats, shape ``[n]``).

    Rules: at least one completion token; every log-prob finite and at most
    :data:`LOGPROB_TOLERANCE` (a log-probability is ``log p <= 0``); token ids in
    ``[0, vocab_size)``; expert ids in ``[0, MAX_EXPERTS)``. Three numpy reductions a turn: the
    token ids of both arrays read as one unsigned array (a negative id reads as >= 2^31), so one
    ``max`` bounds them from both sides.

    Raises:
        PydanticCustomError: type ``implausible``; its message starts with the field's name.
    """
    if not len(completion_ids):
        raise _implausible("completion_token_ids: a model turn has at least one completion token")
    lp = np.frombuffer(logprobs.raw, dtype="<f4")
    if not (lp.max() <= LOGPROB_TOLERANCE and lp.min() > -np.inf):  # NaN fails both comparisons
        bad = int(np.flatnonzero(~np.isfinite(lp) | (lp > LOGPROB_TOLERANCE))[0])
        raise _implausible(
            f"completion_logprobs: {float(lp[bad])!r} at index {bad} is not a log-probability (finite and <= 0)"
        )
    if np.frombuffer(prompt_ids.raw + completion_ids.raw, dtype="<u4").max() >= vocab_size:
        _check_ids("completion_token_ids", completion_ids.numpy(), vocab_size)
        _check_ids("prompt_token_ids", prompt_ids.numpy(), vocab_size)
    if routed_experts is not None and len(routed_experts):
        if np.frombuffer(routed_experts.raw, dtype="<u4").max() >= MAX_EXPERTS:
            _check_ids("routed_experts", routed_experts.numpy(), MAX_EXPERTS)


class TimeWindow(NamedTuple):
    """The ``occurred_at`` values plausible at one ingestion time (aware datetimes, inclusive)."""

    earliest: datetime
    latest: datetime

    @classmethod
    def around(cls, now: datetime, max_skew_s: float, max_age_s: float) -> "TimeWindow":
        """From ``max_age_s`` seconds before ``now`` (a producer's disk spool delivers late, a
        redriven dead letter later still) to ``max_skew_s`` seconds after it (a clock running ahead)."""
        return cls(now - timedelta(seconds=max_age_s), now + timedelta(seconds=max_skew_s))


def check_occurred_at(occurred_at: datetime, window: TimeWindow) -> str | None:
    """Why ``occurred_at`` (aware) falls outside ``window``, naming the field, or None."""
    if occurred_at > window.latest:
        return f"occurred_at: {occurred_at.isoformat()} is after {window.latest.isoformat()} (ingestion time + skew)"
    if occurred_at < window.earliest:
        return (
            f"occurred_at: {occurred_at.isoformat()} is before {window.earliest.isoformat()} "
            f"(ingestion time - maximum age)"
        )
    return None

"""The training cycle's span links to the producer spans behind the trajectories it trains on.

The last hop of a promotion's walk back through the loop (``app.core.telemetry``): every stored
event keeps the trace and span id of the producer span that emitted it (``event_log.trace_id``,
``span_id``), and the ``trainer.cycle`` span links to those spans. A cycle may train on thousands of
trajectories while a span keeps a bounded number of links (the OpenTelemetry SDK's default limit is
128), so it links at most :data:`MAX_PRODUCER_LINKS` distinct producer spans, spread over the
trajectories: every trajectory's first span before any trajectory's second, and when one such
round does not fit, evenly spaced trajectories of it. The span records how many distinct producer
spans there were (``flywheel.producer_spans``) and how many it links
(``flywheel.producer_spans.linked``).

Invariant: each link names a span that emitted an event the manifest lists for a trajectory the
cycle trains on, with that trajectory's id and that event's id as the link's attributes. The W3C
sampled flag is not stored, so linked contexts carry flags ``00``.
"""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence

from opentelemetry import trace
from sqlalchemy.orm import Session

from app.core.telemetry import link_references
from app.repositories.events import producer_spans
from trainer.data import TrajectoryData

MAX_PRODUCER_LINKS = 64
"""Producer spans one ``trainer.cycle`` span links to, at most (half the SDK's default link limit)."""


def choose_producer_links(
    trajectories: Sequence[TrajectoryData], spans: Mapping[uuid.UUID, tuple[str, str]], limit: int
) -> tuple[list[tuple[str, dict[str, str]]], int]:
    """The producer spans to link (see the module docstring for the order), and how many distinct
    producer spans the trajectories' events have in all.

    Args:
        trajectories: the cycle's used trajectories, in order (their ``event_ids``: manifest order).
        spans: ``{event_id: (trace id, span id)}`` (:func:`app.repositories.events.producer_spans`).
        limit: links at most (>= 0).

    Returns:
        ``([(traceparent, {"flywheel.trajectory_id", "flywheel.event_id"}), ...], distinct spans)``.
    """
    per_trajectory: list[list[tuple[str, dict[str, str]]]] = []
    seen: set[tuple[str, str]] = set()
    for t in trajectories:
        mine: list[tuple[str, dict[str, str]]] = []
        for event_id in t.event_ids:
            key = spans.get(uuid.UUID(event_id))
            if key is None or key in seen:
                continue
            seen.add(key)
            reference = f"00-{key[0]}-{key[1]}-00"
            mine.append((reference, {"flywheel.trajectory_id": str(t.id), "flywheel.event_id": event_id}))
        per_trajectory.append(mine)
    chosen: list[tuple[str, dict[str, str]]] = []
    depth = 0
    while len(chosen) < limit:
        layer = [mine[depth] for mine in per_trajectory if len(mine) > depth]
        if not layer:
            break
        room = limit - len(chosen)
        if len(layer) > room:  # evenly spaced over the trajectories of this round
            layer = [layer[i * len(layer) // room] for i in range(room)]
        chosen += layer
        depth += 1
    return chosen, len(seen)


def link_producer_spans(
    session: Session,
    trajectories: Sequence[TrajectoryData],
    span: trace.Span | None = None,
    limit: int = MAX_PRODUCER_LINKS,
) -> int:
    """Link ``span`` (default: the current span, the cycle's) to the producer spans of the
    trajectories' events (see the module docstring) and set its ``flywheel.producer_spans`` and
    ``flywheel.producer_spans.linked`` attributes. Reads ``event_log`` (one query).

    Returns:
        How many links were added.
    """
    span = span or trace.get_current_span()
    ids = [uuid.UUID(e) for t in trajectories for e in t.event_ids]
    chosen, distinct = choose_producer_links(trajectories, producer_spans(session, ids), limit)
    added = link_references(chosen, span)
    span.set_attributes({"flywheel.producer_spans": distinct, "flywheel.producer_spans.linked": added})
    return added

"""The counts of ingest: what one batch did (:class:`BatchOutcome`) and the totals of a run (:class:`IngestStats`).

Invariants:
- Every integer count named in ``_SUMMED`` and the ``dead_letters`` / ``finalized`` counters add up
  the same way in both: an outcome merged into another (the record-isolating path) and an outcome
  folded into the run totals count each record once.
- ``BatchOutcome.messages`` counts the records handed to the batch; a merge leaves it to the caller.
- ``BatchOutcome.next_offsets`` merges by maximum: the offsets only advance.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from consumers.erasure import ErasureOutcome

_SUMMED = ("stale", "stored", "duplicates", "privacy_dropped", "erased_dropped", "trajectories")
"""The integer counts a batch outcome and the run totals both add up."""


def _add_counts(total: BatchOutcome | IngestStats, o: BatchOutcome) -> None:
    for name in _SUMMED:
        setattr(total, name, getattr(total, name) + getattr(o, name))
    total.dead_letters.update(o.dead_letters)
    total.finalized.update(o.finalized)


@dataclass
class BatchOutcome:
    """Counts of what one batch did (for metrics and tests)."""

    messages: int = 0
    stale: int = 0
    stored: int = 0
    """events appended to ``event_log``, less those of sessions the batch itself then purged as private
    (counted in ``privacy_dropped``, the sessions' tombstones); events an erasure request later in the
    batch deleted count here and in that request's ``events_deleted``."""
    duplicates: int = 0
    dead_letters: Counter[str] = field(default_factory=Counter)
    privacy_dropped: int = 0
    erased_dropped: int = 0
    erasures: list[ErasureOutcome] = field(default_factory=list)
    finalized: Counter[str] = field(default_factory=Counter)
    trajectories: int = 0
    next_offsets: dict[tuple[str, int], int] = field(default_factory=dict)
    dead_letter_positions: list[tuple[str, int, int, str | None]] = field(default_factory=list)
    """(topic, partition, offset, log id) of the dead letters the batch stored (an erasure later in the batch may
    have deleted some again): what the caller publishes to the DLQ topic before it commits."""
    offset_gaps: dict[tuple[str, int], tuple[int, int]] = field(default_factory=dict)
    """(topic, partition) -> (the group's stored next offset, the batch's first offset on it) where the
    batch starts past the stored offset: the broker no longer had the records in between when the
    group read on (retention deleted them before they were consumed), so their events never reach
    the store. The offsets advance past them; the caller reports the loss."""

    foreign_log: dict[tuple[str, int], tuple[str, str]] = field(default_factory=dict)
    """(topic, partition) -> (the log identity stored with the group's offset, the batch's) where they
    differ: the batch's records of that partition were skipped (counted stale), its offset untouched."""

    def merge(self, o: "BatchOutcome") -> None:
        """Add another outcome's counts (its ``messages`` excluded: the caller counted them)."""
        _add_counts(self, o)
        self.erasures += o.erasures
        self.dead_letter_positions += o.dead_letter_positions
        for k, gap in o.offset_gaps.items():
            self.offset_gaps.setdefault(k, gap)
        for k, ids in o.foreign_log.items():
            self.foreign_log.setdefault(k, ids)
        for k, v in o.next_offsets.items():
            self.next_offsets[k] = max(self.next_offsets.get(k, 0), v)


@dataclass
class IngestStats:
    """Totals of one ``run``."""

    messages: int = 0
    stored: int = 0
    duplicates: int = 0
    stale: int = 0
    privacy_dropped: int = 0
    erased_dropped: int = 0
    trajectories: int = 0
    """trajectory writes (a trajectory counts once per batch that folded events into it)."""
    erasures: int = 0
    """erasure requests applied."""
    dead_letters: Counter[str] = field(default_factory=Counter)
    finalized: Counter[str] = field(default_factory=Counter)
    batches: int = 0
    processing_errors: int = 0
    first_record_at: float | None = None
    """``time.monotonic()`` when the first record was polled (after the group join)."""
    last_batch_at: float | None = None
    """``time.monotonic()`` when the last batch was committed."""

    def add(self, o: BatchOutcome) -> None:
        """Fold one batch's counts in."""
        self.messages += o.messages
        _add_counts(self, o)
        self.erasures += len(o.erasures)
        self.batches += 1

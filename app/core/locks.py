"""Every Postgres advisory-lock key flywheel takes, in one registry, so no two uses share a key.

Single-key locks are bigints: the ASCII tag ``"flyw"`` (``0x666C7977``) in the high 32 bits and a
small number in the low ones (the projection lock is the bare tag). Two-key locks use a 32-bit
space of their own (``(space, key)``, a different key space from single-key locks in Postgres).
Named locks (an eval run, a gate) hash their name into a signed bigint.
"""

from __future__ import annotations

import hashlib
from typing import Final

FLYW = 0x666C7977
"""``"flyw"`` in ASCII: the tag of flywheel's single-key advisory locks."""


class AdvisoryLock:
    """Single-key advisory locks (``pg_advisory_xact_lock(key)`` and friends): plain ``int`` keys."""

    PROJECTION: Final[int] = FLYW
    """Consumers: projection batches (shared) against erasure and replay (exclusive), per transaction."""
    PRODUCTION: Final[int] = (FLYW << 32) | 1
    """Promotion service: serialises production changes (promote, roll back), per transaction."""
    RELAY: Final[int] = (FLYW << 32) | 2
    """Outbox relay: one relay publishes at a time (try-lock, per transaction)."""
    CYCLE: Final[int] = (FLYW << 32) | 5
    """Trainer: one training cycle at a time (session-level try-lock on its own connection)."""
    HOLDOUT: Final[int] = (FLYW << 32) | 6
    """Eval mining and candidate registration: the held-out set against what a candidate trained on."""
    EVENT_PARTITIONS: Final[int] = (FLYW << 32) | 7
    """Consumers: one pass creating ``event_log`` partitions or archiving them at a time (try-lock, per transaction)."""


PRIVACY_LOCK_SPACE = 0x70727679
"""``"prvy"``: the space of the two-key session-bucket locks the consumers take (``(space, bucket)``)."""


def named_lock_key(*parts: str) -> int:
    """The advisory-lock key of a named lock (e.g. ``("eval", checkpoint, suite, version)``): the first
    8 bytes of SHA-256 over the parts joined by U+001F, as a signed bigint (Postgres's ``bigint``)."""
    digest = hashlib.sha256("\x1f".join(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big", signed=True)

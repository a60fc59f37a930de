"""Sticky canary assignment: which arm serves a user during one canary.

Invariant: the arm is a pure function of ``(user_id, canary_id, fraction)``, computed with sha256
(never Python's salted ``hash``), so every serving replica, the simulator and any later analysis
agree on it, and one user sees one checkpoint for the whole canary. Randomising by user rather
than by request is what makes the per-user clustered interval of ``app.lifecycle.online`` valid
(Deng, Knoblich, Lu 2018, "Applying the Delta Method in Metric Analytics", arXiv 1803.06336).
No database, no torch: serving imports this.
"""

from __future__ import annotations

import hashlib

CANARY = "canary"
PRODUCTION = "production"
_SCALE = float(1 << 64)


def user_bucket(user_id: str, canary_id: str) -> float:
    """A uniform number in [0, 1) from the first 8 bytes of ``sha256(canary_id + "\\0" + user_id)``.

    Salting with the canary id draws a fresh split per canary, so the same users are not always
    the ones exposed first.
    """
    digest = hashlib.sha256(f"{canary_id}\0{user_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / _SCALE


def assign_arm(user_id: str, canary_id: str, fraction: float) -> str:
    """``"canary"`` if ``user_bucket(user_id, canary_id) < fraction`` else ``"production"``.

    Raises:
        ValueError: ``fraction`` outside [0, 1].
    """
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"canary fraction must be in [0, 1], got {fraction}")
    return CANARY if user_bucket(user_id, canary_id) < fraction else PRODUCTION

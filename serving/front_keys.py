"""Who may call the serving front: the product backend's keys, API tokens of role ``inference``.

Invariant: every completion and model-list request carries ``Authorization: Bearer <key>`` of a
live ``inference`` token (``flywheel tokens create --role inference --name product-backend``), or it
is answered 401 in OpenAI's error shape and never reaches a model server. The key is the caller's
own: the front never accepts the vLLM servers' key (``FLYWHEEL_SERVING_API_KEY``), which it alone
adds upstream. Keys are looked up by their sha256 (``app.repositories.tokens.authenticate``) and each
answer, a caller or a refusal, is kept for ``ttl_s`` seconds, so the database sees at most one
lookup per key per ``ttl_s`` and a revoked key stops working within ``ttl_s``. ``/healthz`` stays
open for probes.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from app.core.db import session_scope
from app.repositories.tokens import authenticate, hash_token

INFERENCE_ROLE = "inference"
"""The role whose tokens the front accepts (``app.repositories.tokens.PERMISSIONS``: ``infer`` only)."""


@dataclass(frozen=True)
class Caller:
    """An authenticated caller of the front: the token's name is what the front logs."""

    name: str
    token_id: str


Lookup = Callable[[str], "Caller | None"]
"""A key's caller, or None for an unknown, revoked or wrong-role key (may block on the database)."""


def token_lookup(raw: str) -> Caller | None:
    """The caller of a live ``inference`` token, from the database (one short transaction).

    Raises:
        sqlalchemy.exc.OperationalError: the database cannot be reached.
    """
    with session_scope() as session:
        principal = authenticate(session, raw)
    if principal is None or not principal.can("infer"):
        return None
    return Caller(principal.name, str(principal.token_id))


class FrontKeys:
    """The front's key check: ``lookup`` behind a per-key cache of ``ttl_s`` seconds (thread-safe).

    Args:
        lookup: resolves a plaintext key (default :func:`token_lookup`, the token table).
        ttl_s: seconds an answer (caller or refusal) is reused; a revocation takes effect within it.
        clock: monotonic seconds (tests pass their own).
    """

    def __init__(
        self, lookup: Lookup = token_lookup, *, ttl_s: float = 30.0, clock: Callable[[], float] = time.monotonic
    ):
        self._lookup, self._ttl, self._clock = lookup, ttl_s, clock
        self._cache: dict[str, tuple[float, Caller | None]] = {}
        self._lock = threading.Lock()

    def cached(self, raw: str) -> tuple[bool, Caller | None]:
        """``(hit, caller)``: whether a fresh answer for ``raw`` is cached, and that answer."""
        key = hash_token(raw)
        with self._lock:
            entry = self._cache.get(key)
        if entry is not None and self._clock() - entry[0] < self._ttl:
            return True, entry[1]
        return False, None

    def resolve(self, raw: str) -> Caller | None:
        """The caller of ``raw``, from the cache or ``lookup`` (which may block: call it off the
        event loop). Raises what ``lookup`` raises (nothing is cached then)."""
        hit, caller = self.cached(raw)
        if hit:
            return caller
        caller = self._lookup(raw)
        with self._lock:
            if len(self._cache) > 10_000:  # a flood of random keys must not grow the cache without bound
                self._cache.clear()
            self._cache[hash_token(raw)] = (self._clock(), caller)
        return caller


def bearer_key(authorization: str | None) -> str | None:
    """The key of an ``Authorization: Bearer <key>`` header; None when absent or of another scheme."""
    if not authorization:
        return None
    scheme, _, key = authorization.partition(" ")
    key = key.strip()
    return key if scheme.lower() == "bearer" and key else None

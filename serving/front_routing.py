"""Where the serving front sends a user's request, and which checkpoint answers it.

Invariants:

- a user's arm is ``app.lifecycle.assignment.assign_arm(user_id, canary_id, fraction)`` (sha256,
  sticky for the whole canary), the one assignment the canary analysis and every replica use;
- a request goes to the canary server only when that server itself reports the canary's
  checkpoint as its weight version (``GET /weight_info``); a canary server that is missing,
  starting, down or serving something else leaves every user on production;
- the checkpoint stamped on a response is the weight version its server reported, read at most
  ``ttl_s`` seconds before the request and re-read after every lifecycle change
  (:meth:`FrontRouter.invalidate`), never taken from a lifecycle message;
- one read of a report is in flight per server and lifecycle generation: the requests that find
  the cache stale wait for that read rather than each sending their own, and a read waits as long
  as a completion may (the client's timeout), since a server busy with a batch answers its small
  routes late too (64 concurrent sessions on a 2-core CPU server took over 10 s to get an answer to
  ``/weight_info`` while generating);
- the routing state (the active canary) is swapped whole under a lock, so a request routes by one
  canary or none, and a request already sent keeps its upstream connection whatever changes after.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

import httpx

from app.lifecycle.assignment import CANARY, PRODUCTION, assign_arm

UNKNOWN_CHECKPOINT = "unknown"  # stamped when the server records no weight version


class UpstreamUnavailable(Exception):
    """The upstream server does not answer (connection refused, timeout) or errs (5xx)."""


@dataclass(frozen=True)
class Canary:
    """The active canary: ``checkpoint_id`` serves users whose arm hash is below ``fraction``."""

    canary_id: str
    checkpoint_id: str
    fraction: float


@dataclass(frozen=True)
class Route:
    """Where one request goes: ``arm`` (``production`` | ``canary``), the server's base ``url``, and
    the checkpoint that server reports it serves."""

    arm: str
    url: str
    checkpoint_id: str


@dataclass(frozen=True)
class _Cached:
    value: object
    generation: int
    read_at: float


class FrontRouter:
    """The routing state of one front process and the servers' reported checkpoints (cached).

    Args:
        production_url: base URL of the production server (vLLM, without ``/v1``).
        canary_url: returns the canary server's base URL now, or None when there is none
            (``FLYWHEEL_SERVING_CANARY_URL``, else the managed canary server's state file).
        client: the pooled async HTTP client every upstream call goes through.
        ttl_s: most seconds a server's reported checkpoint is reused before it is read again.
        headers: sent with every upstream call (the upstream's bearer token).
    """

    def __init__(
        self,
        production_url: str,
        canary_url: Callable[[], str | None],
        client: httpx.AsyncClient,
        *,
        ttl_s: float = 1.0,
        headers: dict[str, str] | None = None,
    ) -> None:
        self.production_url = production_url.rstrip("/")
        self._canary_url = canary_url
        self.client = client
        self.ttl_s = ttl_s
        self.headers = dict(headers or {})
        self._lock = threading.Lock()
        self._canary: Canary | None = None
        self._generation = 0
        self._cache: dict[str, _Cached] = {}
        self._inflight: dict[tuple[str, int], asyncio.Future[object]] = {}  # event-loop side only

    @property
    def canary(self) -> Canary | None:
        """The canary routed to now (None: every user on production)."""
        with self._lock:
            return self._canary

    def set_canary(self, canary: Canary | None) -> None:
        """Route by ``canary`` from the next request on (None: every user on production)."""
        with self._lock:
            self._canary = canary
            self._generation += 1

    def invalidate(self) -> None:
        """Forget every cached server report (after a lifecycle change): the next request re-reads."""
        with self._lock:
            self._generation += 1

    def arm_of(self, user_id: str, canary: Canary | None = None) -> str:
        """``canary`` or ``production``: the user's arm under ``canary`` (default: the active one)."""
        canary = canary if canary is not None else self.canary
        if canary is None:
            return PRODUCTION
        return assign_arm(user_id, canary.canary_id, canary.fraction)

    def _fresh(self, key: str) -> _Cached | None:
        with self._lock:
            hit, generation = self._cache.get(key), self._generation
        if hit is None or hit.generation != generation or time.monotonic() - hit.read_at > self.ttl_s:
            return None
        return hit

    def _store(self, key: str, value: object, generation: int) -> object:
        with self._lock:
            self._cache[key] = _Cached(value, generation, time.monotonic())
        return value

    async def _read(self, key: str, fetch: Callable[[], Awaitable[object]]) -> object:
        """The cached report ``key``, else the one read in flight for this generation, else a new
        read by ``fetch`` (stored under the generation it started in); see the module invariants.

        Raises:
            UpstreamUnavailable: as ``fetch`` raises it, to every request waiting on that read.
        """
        hit = self._fresh(key)
        if hit is not None:
            return hit.value
        with self._lock:
            generation = self._generation
        flight = self._inflight.get((key, generation))
        if flight is None:

            async def read() -> object:
                try:
                    return self._store(key, await fetch(), generation)
                finally:
                    self._inflight.pop((key, generation), None)

            flight = asyncio.ensure_future(read())
            self._inflight[(key, generation)] = flight
        return await asyncio.shield(flight)  # a cancelled request leaves the shared read running

    async def served_checkpoint(self, url: str) -> str | None:
        """The weight version the server at ``url`` reports (``GET /weight_info``), or None when it
        records none (``default``) or has no such route; cached (see the module invariants).

        Raises:
            UpstreamUnavailable: the server does not answer or errs.
        """

        async def fetch() -> str | None:
            try:
                resp = await self.client.get(url + "/weight_info", headers=self.headers)
            except httpx.HTTPError as exc:
                raise UpstreamUnavailable(f"{url} does not answer ({type(exc).__name__}: {exc})") from exc
            if resp.status_code == 404:
                return None
            if resp.status_code >= 400:
                raise UpstreamUnavailable(f"{url}/weight_info -> {resp.status_code}: {resp.text[:200]}")
            version = resp.json().get("weight_version")
            return None if version in (None, "", "default") else str(version)

        return await self._read("weight:" + url, fetch)  # type: ignore[return-value]

    async def models(self) -> dict:
        """The production server's ``GET /v1/models`` answer (the model names the front accepts),
        cached like the checkpoint reports.

        Raises:
            UpstreamUnavailable: the production server does not answer or errs.
        """

        async def fetch() -> dict:
            url = self.production_url
            try:
                resp = await self.client.get(url + "/v1/models", headers=self.headers)
            except httpx.HTTPError as exc:
                raise UpstreamUnavailable(f"{url} does not answer ({type(exc).__name__}: {exc})") from exc
            if resp.status_code >= 400:
                raise UpstreamUnavailable(f"{url}/v1/models -> {resp.status_code}: {resp.text[:200]}")
            return resp.json()

        return await self._read("models", fetch)  # type: ignore[return-value]

    async def model_names(self) -> set[str]:
        """Ids of the models the production server serves (see :meth:`models`)."""
        return {str(m.get("id")) for m in (await self.models()).get("data") or []}

    def canary_base_url(self) -> str | None:
        """The canary server's base URL (the ``canary_url`` callable's answer, cached like the reports)."""
        hit = self._fresh("canary_url")
        if hit is not None:
            return hit.value  # type: ignore[return-value]
        with self._lock:
            generation = self._generation
        return self._store("canary_url", self._canary_url(), generation)  # type: ignore[return-value]

    async def route(self, user_id: str) -> Route:
        """Where ``user_id``'s request goes now (see the module invariants).

        Raises:
            UpstreamUnavailable: the user's request would go to production and production does not answer.
        """
        canary = self.canary
        if canary is not None and self.arm_of(user_id, canary) == CANARY:
            url = self.canary_base_url()
            if url:
                url = url.rstrip("/")
                try:
                    if await self.served_checkpoint(url) == canary.checkpoint_id:
                        return Route(CANARY, url, canary.checkpoint_id)
                except UpstreamUnavailable:
                    pass  # a canary server that is starting or down: production serves its users
        return await self.production_route()

    async def production_route(self) -> Route:
        """The production server's route.

        Raises:
            UpstreamUnavailable: production does not answer.
        """
        served = await self.served_checkpoint(self.production_url)
        return Route(PRODUCTION, self.production_url, served or UNKNOWN_CHECKPOINT)

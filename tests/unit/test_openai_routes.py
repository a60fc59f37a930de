"""The OpenAI-compatible client turns vLLM's routed experts (indexed by the position each token was
input at) into the engine's convention (the position whose output sampled the token): checked against
the reference engine's own recording of the same completion, answered in vLLM 0.32's response shape
(``choices[i].routed_experts``: base64 ``.npy``, rows from ``routed_experts_prompt_start``)."""

from __future__ import annotations

import base64
import io
import json

import httpx
import numpy as np
import pytest
import torch

from app.core.errors import InfrastructureError
from app.inference.engine import SamplingParams
from serving.openai_engine import OpenAICompatEngine, sampling_routes
from serving.reference_engine import ReferenceEngine

PROMPT = [1] + list(range(300, 320))


def _per_position_routes(engine: ReferenceEngine, ids: list[int]) -> np.ndarray:
    """``[len(ids), layers, top_k]``: the experts each input position was routed to (vLLM's convention)."""
    from trainer.router_replay import moe_routers

    seen: list[torch.Tensor] = []
    hooks = [r.register_forward_hook(lambda m, a, out: seen.append(out[2])) for r in moe_routers(engine.model)]
    with torch.no_grad():
        engine.model(input_ids=torch.tensor([ids]))
    for h in hooks:
        h.remove()
    return torch.stack(seen, dim=1).numpy()


def numpy2base64(array: np.ndarray) -> str:
    """vLLM's encoding of routed experts (``vllm.utils.serial_utils.numpy2base64``, 0.32)."""
    with io.BytesIO() as buffer:
        np.save(buffer, array, allow_pickle=False)
        return base64.b64encode(buffer.getbuffer()).decode("ascii")


def test_the_encoding_is_vllms_own():
    vllm_serial = pytest.importorskip("vllm.utils.serial_utils")
    routes = np.arange(24, dtype=np.uint8).reshape(3, 4, 2)
    assert numpy2base64(routes) == vllm_serial.numpy2base64(routes)


def _vllm_like_server(gens, routes: list[np.ndarray], prompts: list[list[int]]):
    """An httpx transport answering ``/v1/models`` and ``/v1/completions`` the way vLLM 0.32 does with
    ``--enable-return-routed-experts``: per choice, the rows of ``routes`` (per input position of
    prompt + completion) from the request's ``routed_experts_prompt_start`` to the last position
    forwarded (the final sampled token is not)."""

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/models":
            return httpx.Response(200, json={"data": [{"id": "moe", "max_model_len": 2048}]})
        if request.url.path != "/v1/completions":
            return httpx.Response(404)
        body = json.loads(request.content)
        assert body["prompt"] == prompts
        start = body["routed_experts_prompt_start"]
        choices = [
            {
                "index": i,
                "token_ids": gen.token_ids,
                "finish_reason": gen.finish_reason,
                "logprobs": {"token_logprobs": gen.logprobs},
                "routed_experts": numpy2base64(r[start : len(r) - 1].astype(np.uint8)),
            }
            for i, (gen, r) in enumerate(zip(gens, routes))
        ]
        return httpx.Response(200, json={"choices": choices})

    return httpx.MockTransport(handle)


def test_vllm_routes_come_back_in_the_engines_convention(tiny_moe_model_dir):
    """Two prompts of different lengths in one request: each choice's routes equal what the reference
    engine recorded while sampling the same completion."""
    engine = ReferenceEngine(tiny_moe_model_dir, num_threads=1)
    prompts = [PROMPT, PROMPT[:9]]
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=3)
    gens = [engine.generate([p], params)[0] for p in prompts]
    routes = [_per_position_routes(engine, p + g.token_ids) for p, g in zip(prompts, gens)]
    client = OpenAICompatEngine("http://vllm", transport=_vllm_like_server(gens, routes, prompts))
    got = client.generate(prompts, SamplingParams(max_tokens=8, temperature=1.0))
    assert [g.token_ids for g in got] == [g.token_ids for g in gens]
    assert [g.routed_experts for g in got] == [g.routed_experts for g in gens]


def test_routes_are_left_out_when_absent_and_refused_when_short_or_not_vllms_encoding():
    rows = numpy2base64(np.arange(20, dtype=np.uint8).reshape(5, 2, 2))
    assert sampling_routes({}, 3, 0, 4) is None  # a dense model / the flag off / vLLM's CPU build
    assert sampling_routes({"routed_experts": None}, 3, 0, 4) is None
    routes = sampling_routes({"routed_experts": rows}, 3, 1, 4)  # rows from position 1: token 0 is row 1
    assert routes == np.arange(20).reshape(5, 2, 2)[1:5].tolist()
    with pytest.raises(InfrastructureError, match="rows"):
        sampling_routes({"routed_experts": rows}, 3, 0, 4)  # needs rows 2..5
    with pytest.raises(InfrastructureError, match="base64 .npy"):
        sampling_routes({"routed_experts": [[[0, 1]]]}, 1, 0, 1)  # nested lists are not what vLLM sends

"""``flywheel serve``: the reference engine behind the OpenAI-compatible HTTP subset vLLM speaks, for
tests and hosts without vLLM.

Endpoints: ``GET /health``, ``GET /v1/models``, ``POST /v1/completions`` (token-id or text prompts,
``logprobs``, ``return_token_ids``, ``return_tokens_as_token_ids``, ``stop_token_ids``, ``seed``),
and the vLLM 0.32 endpoints :mod:`serving.openai_engine` reloads weights with: ``POST /pause``,
``POST /collective_rpc`` (methods ``reload_checkpoint`` (flywheel's vLLM worker extension) and
``reload_weights``, with kwargs ``weights_path``), ``POST /reset_prefix_cache``, ``POST
/update_weight_version``, ``GET /weight_info`` and ``POST /resume``. Requests are handled on
FastAPI's thread pool and the engine completes one prompt at a time. Invariant: a reload waits for
the running completion (the engine's lock), so no completion mixes two checkpoints.

Keys as on a managed vLLM server (:func:`serving.vllm_auth.key_check`): with ``api_key`` every route
but ``/health`` wants a key, the reload routes the ``admin_key`` (the inference key gets 403 there,
and without an admin key they answer no one).
"""

from __future__ import annotations

import time
import uuid
from pathlib import Path
from typing import Any

from fastapi import FastAPI, HTTPException
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field

from app.core.errors import FlywheelError
from app.inference.engine import Generation, SamplingParams
from serving.reference_engine import ReferenceEngine
from serving.vllm_auth import key_check


class CompletionRequest(BaseModel):
    """The subset of vLLM's ``/v1/completions`` request flywheel uses (unknown fields ignored)."""

    model_config = ConfigDict(extra="ignore")
    model: str | None = None
    prompt: list[int] | list[list[int]] | str | list[str]
    max_tokens: int = Field(default=16, ge=1)
    temperature: float = Field(default=1.0, ge=0)
    top_p: float = Field(default=1.0, gt=0, le=1)
    n: int = Field(default=1, ge=1, le=64)
    seed: int | None = None
    stop_token_ids: list[int] | None = None
    logprobs: int | None = Field(default=None, ge=0, le=0, description="only the sampled token's log-prob")
    return_token_ids: bool = False
    return_tokens_as_token_ids: bool = False
    skip_special_tokens: bool = True


class WeightVersion(BaseModel):
    """vLLM's ``/update_weight_version`` body: the checkpoint id the server now serves."""

    new_version: str = Field(min_length=1)


class RpcRequest(BaseModel):  # type: ignore[no-redef]  # the pydantic plugin's __init__ names its **kwargs so too
    """vLLM's ``/collective_rpc`` body."""

    method: str
    args: list[Any] = Field(default_factory=list)
    kwargs: dict[str, Any] = Field(default_factory=dict)
    timeout: float | None = None


def create_app(engine: ReferenceEngine, *, api_key: str | None = None, admin_key: str | None = None) -> FastAPI:
    """The FastAPI app serving ``engine``; with keys, bearer ``api_key`` on the inference routes and
    ``admin_key`` on the reload routes (401 without a key, 403 with the other role's)."""
    app = FastAPI(title="flywheel serve", version="1")
    app.middleware("http")(key_check(api_key, admin_key))

    @app.exception_handler(FlywheelError)
    def _domain_error(request, exc: FlywheelError) -> JSONResponse:
        return JSONResponse(
            status_code=exc.status_code if exc.status_code != 500 else 400,
            content={"error": {"message": exc.message, "type": type(exc).__name__}},
        )

    @app.get("/health")
    def health() -> dict[str, str]:
        return {"status": "ok", "checkpoint_id": engine.checkpoint_id}

    @app.get("/v1/models")
    def models() -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                {
                    "id": engine.checkpoint_id,
                    "object": "model",
                    "owned_by": "flywheel",
                    "root": str(engine.model_dir),
                    "checkpoint_id": engine.checkpoint_id,
                    "max_model_len": engine.max_context_tokens,
                }
            ],
        }

    @app.post("/v1/completions")
    def completions(req: CompletionRequest) -> dict[str, Any]:
        return complete(engine, req)

    @app.post("/collective_rpc")
    def collective_rpc(req: RpcRequest) -> dict[str, Any]:
        return call_rpc(engine, req)

    @app.post("/reset_prefix_cache")
    def reset_prefix_cache() -> dict[str, bool]:
        engine.reset_prefix_cache()
        return {"success": True}

    # A reload already waits for running sequences (the engine's invariant): pause and resume only
    # acknowledge, as vLLM's do for a client that needs no more.
    @app.post("/pause")
    def pause() -> dict[str, str]:
        return {"status": "paused"}

    @app.post("/resume")
    def resume() -> dict[str, str]:
        return {"status": "resumed"}

    @app.post("/update_weight_version")
    def update_weight_version(body: WeightVersion) -> dict[str, Any]:
        engine.checkpoint_id = body.new_version
        return {"success": True, "new_version": body.new_version}

    @app.get("/weight_info")
    def weight_info() -> dict[str, str]:
        return {"weight_version": engine.checkpoint_id}

    return app


def _token_prompts(engine: ReferenceEngine, prompt) -> list[list[int]]:
    if isinstance(prompt, str):
        prompt = [prompt]
    if prompt and isinstance(prompt[0], int):
        return [list(prompt)]
    return [engine.tokenizer(p, add_special_tokens=False).input_ids if isinstance(p, str) else list(p) for p in prompt]


def call_rpc(engine: ReferenceEngine, req: RpcRequest) -> dict[str, Any]:
    """The weight move vLLM's ``/collective_rpc`` takes (``reload_checkpoint`` / ``reload_weights``
    with ``weights_path``).

    Raises:
        HTTPException: 400 for another method or a reload without ``weights_path``.
    """
    if req.method in ("reload_checkpoint", "reload_weights"):
        path = req.kwargs.get("weights_path")
        if not path:
            raise HTTPException(status_code=400, detail="reload_weights needs kwargs.weights_path")
        engine.load_checkpoint(Path(path).name, Path(path))
    else:
        raise HTTPException(status_code=400, detail=f"unsupported method {req.method!r}")
    return {"results": [None]}


def complete(engine: ReferenceEngine, req: CompletionRequest) -> dict[str, Any]:
    """Answer one ``/v1/completions`` request as vLLM's server does: ``n`` completions of each
    prompt, token ids and log-probs when asked, usage counted in tokens.

    Raises:
        HTTPException: 400 for an empty prompt.
    """
    prompts = _token_prompts(engine, req.prompt)
    if any(not p for p in prompts):
        raise HTTPException(status_code=400, detail="empty prompt")
    params = SamplingParams(
        max_tokens=req.max_tokens,
        temperature=req.temperature,
        top_p=req.top_p,
        seed=req.seed,
        stop_token_ids=tuple(req.stop_token_ids or ()),
    )
    expanded = [p for p in prompts for _ in range(req.n)]
    gens = engine.generate(expanded, params)
    completion_tokens = sum(len(g.token_ids) for g in gens)
    prompt_tokens = sum(len(p) for p in expanded)
    return {
        "id": f"cmpl-{uuid.uuid4().hex}",
        "object": "text_completion",
        "created": int(time.time()),
        "model": engine.checkpoint_id,
        "choices": [_choice(engine, req, i, g, expanded[i]) for i, g in enumerate(gens)],
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    }


def _choice(
    engine: ReferenceEngine, req: CompletionRequest, index: int, g: Generation, prompt: list[int]
) -> dict[str, Any]:
    text = engine.tokenizer.decode(g.token_ids, skip_special_tokens=req.skip_special_tokens)
    choice: dict[str, Any] = {"index": index, "text": text, "finish_reason": g.finish_reason, "logprobs": None}
    if req.return_token_ids:
        choice["token_ids"] = g.token_ids
        choice["prompt_token_ids"] = prompt
    if req.logprobs is not None:
        tokens = (
            [f"token_id:{t}" for t in g.token_ids]
            if req.return_tokens_as_token_ids
            else engine.tokenizer.convert_ids_to_tokens(g.token_ids)
        )
        choice["logprobs"] = {"tokens": tokens, "token_logprobs": g.logprobs, "top_logprobs": None, "text_offset": None}
    return choice
